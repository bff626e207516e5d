/* OpenAI error bodies, HTTP reason phrases, JSON helpers. */
#include <string.h>

#include "gw_internal.h"

const char *gw_status_reason(int status) {
    switch (status) {
    case 100:
        return "Continue";
    case 101:
        return "Switching Protocols";
    case 200:
        return "OK";
    case 204:
        return "No Content";
    case 400:
        return "Bad Request";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 408:
        return "Request Timeout";
    case 411:
        return "Length Required";
    case 413:
        return "Content Too Large";
    case 415:
        return "Unsupported Media Type";
    case 417:
        return "Expectation Failed";
    case 422:
        return "Unprocessable Content";
    case 429:
        return "Too Many Requests";
    case 431:
        return "Request Header Fields Too Large";
    case 500:
        return "Internal Server Error";
    case 501:
        return "Not Implemented";
    case 502:
        return "Bad Gateway";
    case 503:
        return "Service Unavailable";
    case 504:
        return "Gateway Timeout";
    case 505:
        return "HTTP Version Not Supported";
    default:
        return "Unknown";
    }
}

/* The OpenAI `type` for a status, as the OpenAI API and its SDKs use them. */
static const char *error_type(int status) {
    switch (status) {
    case 401:
        return "authentication_error";
    case 403:
        return "permission_error";
    case 404:
        return "not_found_error";
    case 429:
        return "rate_limit_error";
    default:
        return status >= 500 ? "server_error" : "invalid_request_error";
    }
}

char *gw_json_dump(const json_t *j) {
    char *s = json_dumps(j, JSON_COMPACT);
    if (!s) {
        PD_LOGE(GW_MOD, "out of memory serialising JSON");
        abort();
    }
    return s;
}

json_t *gw_json_text(const char *s, size_t len) {
    json_t *j = json_stringn(s, len);
    if (j)
        return j;
    char *fixed = NULL;
    size_t flen = 0;
    if (pd_tok_utf8_repair(s, len, &fixed, &flen, NULL) != PD_OK)
        return json_string("");
    j = json_stringn(fixed, flen);
    free(fixed);
    return j ? j : json_string("");
}

char *gw_error_json(int status, const char *message, const char *param) {
    json_t *e = json_object();
    const char *msg = message ? message : gw_status_reason(status);
    json_object_set_new(e, "message", gw_json_text(msg, strlen(msg)));
    json_object_set_new(e, "type", json_string(error_type(status)));
    json_object_set_new(e, "param",
                        param && *param ? gw_json_text(param, strlen(param)) : json_null());
    json_object_set_new(e, "code", json_integer(status));
    json_t *root = json_object();
    json_object_set_new(root, "error", e);
    char *s = gw_json_dump(root);
    json_decref(root);
    return s;
}
