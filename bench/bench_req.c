/* One request of `pdserve bench`: the answer parsed as it arrives and
 * judged by the strict rules (pd_bench.h, pd_bench_outcome).
 *
 * SSE framing follows the WHATWG HTML "server-sent events" section: lines
 * end in LF (a CR before it is dropped), "field: value", a blank line
 * dispatches the event, lines starting with ':' are comments; only the data
 * and event fields matter here. The OpenAI streaming format puts one JSON
 * chunk in each data field and ends with `data: [DONE]`; with
 * stream_options.include_usage the last chunk carries usage and no choices.
 */
#include <math.h>
#include <stdarg.h>
#include <string.h>

#include "pd_bench.h"

static const char *const outcome_names[PD_BENCH_N_OUTCOMES] = {
    [PD_BENCH_SUCCESS] = "success",           [PD_BENCH_HTTP_STATUS] = "http_status",
    [PD_BENCH_EMPTY_TEXT] = "empty_text",     [PD_BENCH_NO_DONE] = "no_done",
    [PD_BENCH_WRONG_LENGTH] = "wrong_length", [PD_BENCH_BAD_USAGE] = "bad_usage",
    [PD_BENCH_SSE_ERROR] = "sse_error",       [PD_BENCH_INVALID_UTF8] = "invalid_utf8",
    [PD_BENCH_DISCONNECT] = "disconnect",     [PD_BENCH_TIMEOUT] = "timeout",
};

const char *pd_bench_outcome_str(pd_bench_outcome o) {
    if ((int)o < 0 || o >= PD_BENCH_N_OUTCOMES)
        return "unknown";
    return outcome_names[o];
}

/* ---- buffer ---------------------------------------------------------- */

int pd_bench_buf_append(pd_bench_buf *b, const void *p, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *d = realloc(b->data, cap);
        if (!d)
            return -1;
        b->data = d;
        b->cap = cap;
    }
    if (n)
        memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = 0;
    return 0;
}

int pd_bench_buf_printf(pd_bench_buf *b, const char *fmt, ...) {
    char small[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0)
        return -1;
    if ((size_t)n < sizeof small)
        return pd_bench_buf_append(b, small, (size_t)n);
    char *big = malloc((size_t)n + 1);
    if (!big)
        return -1;
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    int rc = pd_bench_buf_append(b, big, (size_t)n);
    free(big);
    return rc;
}

void pd_bench_buf_free(pd_bench_buf *b) {
    free(b->data);
    memset(b, 0, sizeof *b);
}

/* ---- request lifetime ---------------------------------------------------- */

void pd_bench_req_init(pd_bench_req *r) {
    memset(r, 0, sizeof *r);
    r->prompt_tokens_local = -1;
    r->prompt_tokens = r->completion_tokens = r->total_tokens = -1;
}

void pd_bench_req_clear(pd_bench_req *r) {
    free(r->body);
    pd_bench_buf_free(&r->text);
    pd_bench_buf_free(&r->raw);
    pd_bench_buf_free(&r->line);
    pd_bench_buf_free(&r->data);
    if (r->tool_calls)
        json_decref(r->tool_calls);
    pd_bench_req_init(r);
}

/* Lower rank wins when several in-stream rules are broken. */
static int violation_rank(pd_bench_outcome o) {
    return o == PD_BENCH_INVALID_UTF8 ? 0 : o == PD_BENCH_SSE_ERROR ? 1 : 2;
}

static void violate(pd_bench_req *r, pd_bench_outcome o, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void violate(pd_bench_req *r, pd_bench_outcome o, const char *fmt, ...) {
    if (r->violation != PD_BENCH_SUCCESS && violation_rank(r->violation) <= violation_rank(o))
        return;
    r->violation = o;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->violation_detail, sizeof r->violation_detail, fmt, ap);
    va_end(ap);
}

/* Copies up to 80 bytes of s into out as printable ASCII (others as '?'). */
static void excerpt(char *out, size_t cap, const char *s, size_t len) {
    size_t j = 0;
    for (size_t i = 0; i < len && j + 1 < cap && i < 80; i++) {
        unsigned char c = (unsigned char)s[i];
        out[j++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
    }
    out[j] = 0;
}

/* ---- usage, text, tool calls ---------------------------------------------- */

static bool json_int(const json_t *o, const char *k, int64_t *v) {
    json_t *x = json_object_get(o, k);
    if (!json_is_integer(x))
        return false;
    *v = json_integer_value(x);
    return true;
}

/* usage must be {prompt_tokens >= 1, completion_tokens >= 0, total_tokens =
 * their sum when present}, all integers. */
static void take_usage(pd_bench_req *r, const json_t *u) {
    int64_t p, c, t;
    const char *why = NULL;
    if (!json_is_object(u))
        why = "usage is not an object";
    else if (!json_int(u, "prompt_tokens", &p) || p < 1)
        why = "usage.prompt_tokens missing, not an integer, or < 1";
    else if (!json_int(u, "completion_tokens", &c) || c < 0)
        why = "usage.completion_tokens missing, not an integer, or < 0";
    else if (json_object_get(u, "total_tokens") && (!json_int(u, "total_tokens", &t) || t != p + c))
        why = "usage.total_tokens is not prompt_tokens + completion_tokens";
    if (why) {
        if (!r->bad_usage)
            snprintf(r->usage_detail, sizeof r->usage_detail, "%s", why);
        r->bad_usage = 1;
        return;
    }
    r->have_usage = true;
    r->prompt_tokens = p;
    r->completion_tokens = c;
    r->total_tokens = p + c;
}

static void take_text(pd_bench_req *r, const char *s, size_t len, double now, bool timed) {
    if (len == 0)
        return;
    if (timed) {
        if (r->t_first == 0)
            r->t_first = now;
        r->t_last = now;
    }
    r->n_fragments++;
    if (pd_bench_buf_append(&r->text, s, len))
        violate(r, PD_BENCH_SSE_ERROR, "out of memory keeping the text");
}

/* A streamed tool-call delta {index, id, function: {name, arguments}} or a
 * whole tool call of a message: merged into r->tool_calls[index]. */
static void take_tool_call(pd_bench_req *r, const json_t *tc, size_t pos) {
    if (!json_is_object(tc)) {
        violate(r, PD_BENCH_SSE_ERROR, "a tool call is not an object");
        return;
    }
    json_t *ix = json_object_get(tc, "index");
    size_t i =
        json_is_integer(ix) && json_integer_value(ix) >= 0 ? (size_t)json_integer_value(ix) : pos;
    if (i > 64) {
        violate(r, PD_BENCH_SSE_ERROR, "tool call index %zu out of range", i);
        return;
    }
    if (!r->tool_calls)
        r->tool_calls = json_array();
    while (r->tool_calls && json_array_size(r->tool_calls) <= i)
        json_array_append_new(r->tool_calls,
                              json_pack("{s:s,s:s,s:s}", "id", "", "name", "", "arguments", ""));
    json_t *slot = r->tool_calls ? json_array_get(r->tool_calls, i) : NULL;
    if (!slot) {
        violate(r, PD_BENCH_SSE_ERROR, "out of memory keeping tool calls");
        return;
    }
    json_t *id = json_object_get(tc, "id");
    if (json_is_string(id) && json_string_length(id))
        json_object_set(slot, "id", id);
    json_t *fn = json_object_get(tc, "function");
    json_t *name = json_object_get(fn, "name");
    if (json_is_string(name) && json_string_length(name))
        json_object_set(slot, "name", name);
    json_t *args = json_object_get(fn, "arguments");
    if (json_is_string(args)) {
        const char *old = json_string_value(json_object_get(slot, "arguments"));
        size_t a = strlen(old), b = json_string_length(args);
        char *cat = malloc(a + b + 1);
        if (!cat) {
            violate(r, PD_BENCH_SSE_ERROR, "out of memory keeping tool calls");
            return;
        }
        memcpy(cat, old, a);
        memcpy(cat + a, json_string_value(args), b);
        cat[a + b] = 0;
        json_object_set_new(slot, "arguments", json_string(cat));
        free(cat);
    }
}

static void take_finish(pd_bench_req *r, const json_t *ch) {
    json_t *fr = json_object_get(ch, "finish_reason");
    if (json_is_string(fr))
        snprintf(r->finish_reason, sizeof r->finish_reason, "%s", json_string_value(fr));
}

/* One chunk object (streamed) or the whole answer (not streamed). */
static void take_object(pd_bench_req *r, const json_t *o, double now, bool streamed) {
    json_t *e = json_object_get(o, "error");
    if (e && !json_is_null(e)) {
        json_t *msg = json_is_object(e) ? json_object_get(e, "message") : e;
        char ex[96] = "";
        if (json_is_string(msg))
            excerpt(ex, sizeof ex, json_string_value(msg), json_string_length(msg));
        violate(r, PD_BENCH_SSE_ERROR, "error object in a 200 answer: %s", ex);
        return;
    }
    json_t *choices = json_object_get(o, "choices");
    if (choices && !json_is_array(choices)) {
        violate(r, PD_BENCH_SSE_ERROR, "'choices' is not an array");
        return;
    }
    size_t i;
    json_t *ch;
    json_array_foreach(choices, i, ch) {
        if (!json_is_object(ch)) {
            violate(r, PD_BENCH_SSE_ERROR, "a choice is not an object");
            return;
        }
        take_finish(r, ch);
        if (r->endpoint == PD_BENCH_EP_COMPLETIONS) {
            json_t *t = json_object_get(ch, "text");
            if (t && !json_is_string(t) && !json_is_null(t))
                violate(r, PD_BENCH_SSE_ERROR, "choices[].text is not a string");
            else if (json_is_string(t))
                take_text(r, json_string_value(t), json_string_length(t), now, streamed);
            continue;
        }
        json_t *m = json_object_get(ch, streamed ? "delta" : "message");
        if (!json_is_object(m)) {
            violate(r, PD_BENCH_SSE_ERROR, "choices[].%s is not an object",
                    streamed ? "delta" : "message");
            return;
        }
        /* reasoning text (DeepSeek-R1 on vLLM/SGLang) is generated text too:
         * it times the first token, but only content is the answer */
        json_t *rc = json_object_get(m, "reasoning_content");
        if (json_is_string(rc) && json_string_length(rc) && streamed) {
            if (r->t_first == 0)
                r->t_first = now;
            r->t_last = now;
        }
        json_t *c = json_object_get(m, "content");
        if (c && !json_is_string(c) && !json_is_null(c))
            violate(r, PD_BENCH_SSE_ERROR, "content is not a string");
        else if (json_is_string(c))
            take_text(r, json_string_value(c), json_string_length(c), now, streamed);
        json_t *tcs = json_object_get(m, "tool_calls");
        if (tcs && !json_is_null(tcs)) {
            if (!json_is_array(tcs)) {
                violate(r, PD_BENCH_SSE_ERROR, "tool_calls is not an array");
                return;
            }
            size_t k;
            json_t *tc;
            json_array_foreach(tcs, k, tc) take_tool_call(r, tc, k);
            if (streamed && json_array_size(tcs)) {
                if (r->t_first == 0)
                    r->t_first = now;
                r->t_last = now;
            }
        }
    }
    json_t *u = json_object_get(o, "usage");
    if (u && !json_is_null(u))
        take_usage(r, u);
}

/* Parses JSON text; invalid UTF-8 inside (escapes to lone surrogates) is
 * reported as such. */
static json_t *parse_json(pd_bench_req *r, const char *s, size_t len, const char *what) {
    json_error_t je;
    json_t *o = json_loadb(s, len, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &je);
    if (!o) {
        if (strstr(je.text, "nicode") || strstr(je.text, "UTF-8"))
            violate(r, PD_BENCH_INVALID_UTF8, "%s: %s", what, je.text);
        else {
            char ex[96];
            excerpt(ex, sizeof ex, s, len);
            violate(r, PD_BENCH_SSE_ERROR, "%s: malformed JSON (%s): %s", what, je.text, ex);
        }
        return NULL;
    }
    if (!json_is_object(o)) {
        violate(r, PD_BENCH_SSE_ERROR, "%s: JSON is not an object", what);
        json_decref(o);
        return NULL;
    }
    return o;
}

/* ---- SSE ----------------------------------------------------------------- */

static void dispatch(pd_bench_req *r, double now) {
    const char *d = r->data.data ? r->data.data : "";
    size_t n = r->data.len;
    bool err_event = strcmp(r->event, "error") == 0;
    r->saw_data = false;
    r->event[0] = 0;
    r->data.len = 0;
    r->n_events++;
    char what[48];
    snprintf(what, sizeof what, "event %d", r->n_events);
    if (!pd_tok_utf8_valid(d, n)) {
        violate(r, PD_BENCH_INVALID_UTF8, "%s: data is not valid UTF-8", what);
        return;
    }
    if (err_event) {
        char ex[96];
        excerpt(ex, sizeof ex, d, n);
        violate(r, PD_BENCH_SSE_ERROR, "%s: 'event: error': %s", what, ex);
        return;
    }
    if (n == 6 && !memcmp(d, "[DONE]", 6)) {
        if (r->done)
            violate(r, PD_BENCH_SSE_ERROR, "%s: a second [DONE]", what);
        r->done = true;
        return;
    }
    if (r->done) {
        violate(r, PD_BENCH_SSE_ERROR, "%s: data after [DONE]", what);
        return;
    }
    json_t *o = parse_json(r, d, n, what);
    if (!o)
        return;
    take_object(r, o, now, true);
    json_decref(o);
}

static void sse_line(pd_bench_req *r, const char *s, size_t n, double now) {
    if (n && s[n - 1] == '\r')
        n--;
    if (n == 0) {
        if (r->saw_data)
            dispatch(r, now);
        else
            r->event[0] = 0;
        return;
    }
    if (s[0] == ':')
        return; /* comment / keep-alive */
    const char *colon = memchr(s, ':', n);
    size_t fl = colon ? (size_t)(colon - s) : n;
    const char *v = colon ? colon + 1 : s + n;
    size_t vl = colon ? n - fl - 1 : 0;
    if (vl && *v == ' ')
        v++, vl--;
    if (fl == 4 && !memcmp(s, "data", 4)) {
        if ((r->saw_data && pd_bench_buf_append(&r->data, "\n", 1)) ||
            pd_bench_buf_append(&r->data, v, vl))
            violate(r, PD_BENCH_SSE_ERROR, "out of memory keeping an event");
        r->saw_data = true;
    } else if (fl == 5 && !memcmp(s, "event", 5)) {
        size_t k = vl < sizeof r->event - 1 ? vl : sizeof r->event - 1;
        memcpy(r->event, v, k);
        r->event[k] = 0;
    } else if (!(fl == 2 && !memcmp(s, "id", 2)) && !(fl == 5 && !memcmp(s, "retry", 5))) {
        /* the spec ignores unknown fields; a server that sends them (a JSON
         * body where a stream was asked for, say) is not speaking SSE */
        char ex[96];
        excerpt(ex, sizeof ex, s, n);
        violate(r, PD_BENCH_SSE_ERROR, "not an SSE line: %s", ex);
    }
}

void pd_bench_req_feed(pd_bench_req *r, const char *p, size_t len, double now) {
    if (r->raw.len < PD_BENCH_RAW_MAX) {
        size_t k = len < PD_BENCH_RAW_MAX - r->raw.len ? len : PD_BENCH_RAW_MAX - r->raw.len;
        if (pd_bench_buf_append(&r->raw, p, k))
            r->raw_truncated = true;
        if (k < len)
            r->raw_truncated = true;
    } else
        r->raw_truncated = true;
    if (!r->stream || r->http_status != 200)
        return;
    /* a streamed non-streaming body is parsed at the end; here lines */
    size_t i = 0;
    while (i < len) {
        const char *nl = memchr(p + i, '\n', len - i);
        if (!nl) {
            if (pd_bench_buf_append(&r->line, p + i, len - i))
                violate(r, PD_BENCH_SSE_ERROR, "out of memory keeping a line");
            return;
        }
        size_t k = (size_t)(nl - (p + i));
        if (r->line.len) {
            if (pd_bench_buf_append(&r->line, p + i, k))
                violate(r, PD_BENCH_SSE_ERROR, "out of memory keeping a line");
            sse_line(r, r->line.data, r->line.len, now);
            r->line.len = 0;
        } else
            sse_line(r, p + i, k, now);
        i += k + 1;
    }
}

/* ---- the end ----------------------------------------------------------------- */

static void parse_whole(pd_bench_req *r, double now) {
    const char *d = r->raw.data ? r->raw.data : "";
    if (r->raw_truncated) {
        violate(r, PD_BENCH_SSE_ERROR, "answer larger than %u bytes", PD_BENCH_RAW_MAX);
        return;
    }
    if (!pd_tok_utf8_valid(d, r->raw.len)) {
        violate(r, PD_BENCH_INVALID_UTF8, "body is not valid UTF-8");
        return;
    }
    json_t *o = parse_json(r, d, r->raw.len, "body");
    if (!o)
        return;
    take_object(r, o, now, false);
    json_decref(o);
}

static void set_outcome(pd_bench_req *r, pd_bench_outcome o, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void set_outcome(pd_bench_req *r, pd_bench_outcome o, const char *fmt, ...) {
    r->outcome = o;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->detail, sizeof r->detail, fmt, ap);
    va_end(ap);
}

void pd_bench_req_finish(pd_bench_req *r, int transport, const char *curl_detail, double now) {
    r->t_end = now;
    r->transport = transport;
    if (r->http_status == 200) {
        if (r->stream) {
            if (r->line.len) /* a last line without its newline */
                sse_line(r, r->line.data, r->line.len, now);
            r->line.len = 0;
            if (r->saw_data) /* a last event without its blank line */
                dispatch(r, now);
        } else if (transport == 0)
            parse_whole(r, now);
    }
    r->outcome = PD_BENCH_SUCCESS;
    r->detail[0] = 0;
    if (r->http_status != 0 && r->http_status != 200) {
        char ex[96];
        excerpt(ex, sizeof ex, r->raw.data ? r->raw.data : "", r->raw.len);
        set_outcome(r, PD_BENCH_HTTP_STATUS, "HTTP %ld: %s", r->http_status, ex);
    } else if (r->violation != PD_BENCH_SUCCESS)
        set_outcome(r, r->violation, "%s", r->violation_detail);
    else if (transport == 1)
        set_outcome(r, PD_BENCH_TIMEOUT, "no complete answer after %.3f s (%s)", now - r->t_start,
                    curl_detail ? curl_detail : "timeout");
    else if (transport != 0)
        set_outcome(r, PD_BENCH_DISCONNECT, "%s", curl_detail ? curl_detail : "transport error");
    else if (r->http_status == 0)
        set_outcome(r, PD_BENCH_DISCONNECT, "no HTTP response");
    else if (r->stream && !r->done)
        set_outcome(r, PD_BENCH_NO_DONE, "the stream ended after %d events without [DONE]",
                    r->n_events);
    else if (r->text.len == 0 && json_array_size(r->tool_calls) == 0)
        set_outcome(r, PD_BENCH_EMPTY_TEXT, "no text in %d events", r->n_events);
    else if (r->bad_usage)
        set_outcome(r, PD_BENCH_BAD_USAGE, "%s", r->usage_detail);
    else if (!r->have_usage)
        set_outcome(r, PD_BENCH_BAD_USAGE, "no usage in the answer");
    else if (r->completion_tokens == 0)
        set_outcome(r, PD_BENCH_BAD_USAGE, "usage.completion_tokens is 0 but text came");
    else if (r->exact_length && r->completion_tokens != r->max_tokens)
        set_outcome(r, PD_BENCH_WRONG_LENGTH, "completion_tokens %lld, max_tokens %d (ignore_eos)",
                    (long long)r->completion_tokens, r->max_tokens);
    else if (!r->exact_length && r->max_tokens > 0 && r->completion_tokens > r->max_tokens)
        set_outcome(r, PD_BENCH_WRONG_LENGTH, "completion_tokens %lld > max_tokens %d",
                    (long long)r->completion_tokens, r->max_tokens);
    pd_bench_buf_free(&r->line);
    pd_bench_buf_free(&r->data);
}

double pd_bench_req_ttft(const pd_bench_req *r) {
    if (!r->stream || r->t_first == 0)
        return NAN;
    return r->t_first - r->t_start;
}

double pd_bench_req_tpot(const pd_bench_req *r) {
    if (!r->stream || r->t_first == 0 || r->completion_tokens < 2)
        return NAN;
    return (r->t_last - r->t_first) / (double)(r->completion_tokens - 1);
}

double pd_bench_req_e2e(const pd_bench_req *r) {
    if (r->t_end == 0)
        return NAN;
    return r->t_end - r->t_start;
}
