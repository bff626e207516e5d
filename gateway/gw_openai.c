/* OpenAI request bodies → validated generation parameters and prompt ids.
 * Runs on tokenizer worker threads: pure, reads only cfg and tok.
 *
 * The contract (issue "Gateway completeness", "The OpenAI contract"): every
 * failure is a client error with the offending parameter named; unknown
 * fields are accepted; null means "not given". Ranges are vLLM's
 * (vllm/entrypoints/openai/protocol.py, vllm/sampling_params.py):
 * temperature [0, 2], top_p (0, 1], top_k >= -1, min_p [0, 1],
 * presence/frequency penalty [-2, 2], repetition_penalty [1e-30, 1e9], n [1, 128],
 * top_logprobs / logprobs [0, --max-logprobs], seed int64.
 * logit_bias: OpenAI's shape and range ({"<token id>": bias in [-100, 100]},
 * at most PD_MAX_LOGIT_BIAS = 1024 entries); a bias out of range is refused,
 * where vLLM clamps it into the range.
 */
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "gw_internal.h"
#include "pd_grammar.h"

#define GW_MAX_N 128
/* /v1/completions without max_tokens: OpenAI's and vLLM's default */
#define GW_COMPLETIONS_DEFAULT_MAX_TOKENS 16

static int fail(gw_oai_err *e, int status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static int fail(gw_oai_err *e, int status, const char *param, const char *fmt, ...) {
    e->status = status;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return -1;
}

/* The field, or NULL when absent or null. */
static json_t *field(const json_t *o, const char *key) {
    json_t *v = json_object_get(o, key);
    return json_is_null(v) ? NULL : v;
}

/* vLLM's request extensions that would change the output and are not
 * implemented: refused with a 400 naming the field rather than ignored (a
 * client asking for guided output must not get unconstrained text). Their
 * values that ask for nothing (null, false, an empty list, length_penalty
 * 1) are taken. Other unknown fields stay ignored (docs/api.md). */
static int refuse_vllm_extras(gw_kind kind, const json_t *root, gw_oai_err *e) {
    static const struct {
        const char *name, *hint;
    } named[] = {
        /* completions: echo + logprobs report the prompt's */
        {"prompt_logprobs", "; for the prompt tokens' logprobs use a completion with 'echo': true and 'logprobs'"},
        {"guided_json", "; use 'response_format' with a json_schema"},
        {"guided_regex", ""},
        {"guided_choice", ""},
        {"guided_grammar", ""},
        {"structured_outputs", "; use 'response_format' with a json_schema"},
        {"truncate_prompt_tokens", ""},
    };
    for (size_t i = 0; i < sizeof named / sizeof named[0]; i++)
        if (field(root, named[i].name))
            return fail(e, 400, named[i].name, "'%s' is not supported%s", named[i].name, named[i].hint);
    static const char *const lists[] = {"allowed_token_ids", "bad_words"};
    for (size_t i = 0; i < sizeof lists / sizeof lists[0]; i++) {
        json_t *v = field(root, lists[i]);
        if (v && !(json_is_array(v) && json_array_size(v) == 0))
            return fail(e, 400, lists[i], "'%s' is not supported", lists[i]);
    }
    static const char *const flags[] = {"use_beam_search", "return_tokens_as_token_ids", "return_token_ids"};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) {
        json_t *v = field(root, flags[i]);
        if (v && !json_is_false(v))
            return fail(e, 400, flags[i], "'%s' is not supported", flags[i]);
    }
    json_t *lp = field(root, "length_penalty");
    if (lp && !(json_is_number(lp) && json_number_value(lp) == 1.0))
        return fail(e, 400, "length_penalty", "'length_penalty' (beam search) is not supported");
    if (kind == GW_KIND_CHAT && field(root, "chat_template"))
        return fail(e, 400, "chat_template",
                    "'chat_template' is not supported: the model's DeepSeek chat format is built in");
    return 0;
}

static int get_bool(const json_t *o, const char *key, bool *out, gw_oai_err *e) {
    json_t *v = field(o, key);
    if (!v)
        return 0;
    if (!json_is_boolean(v))
        return fail(e, 400, key, "'%s' must be a boolean", key);
    *out = json_is_true(v);
    return 0;
}

/* An integer (an integral real such as 5.0 too, as pydantic accepts). */
static bool as_int64(const json_t *v, int64_t *out) {
    if (json_is_integer(v)) {
        *out = (int64_t)json_integer_value(v);
        return true;
    }
    if (json_is_real(v)) {
        double d = json_real_value(v);
        if (isfinite(d) && d == floor(d) && d >= -9223372036854775808.0 &&
            d < 9223372036854775808.0) {
            *out = (int64_t)d;
            return true;
        }
    }
    return false;
}

static int get_int(const json_t *o, const char *key, int64_t *out, bool *present, gw_oai_err *e) {
    json_t *v = field(o, key);
    if (present)
        *present = v != NULL;
    if (!v)
        return 0;
    if (!as_int64(v, out))
        return fail(e, 400, key, "'%s' must be an integer", key);
    return 0;
}

static int get_int_range(const json_t *o, const char *key, int64_t lo, int64_t hi, int64_t *out,
                         bool *present, gw_oai_err *e) {
    bool have = false;
    if (get_int(o, key, out, &have, e))
        return -1;
    if (present)
        *present = have;
    if (have && (*out < lo || *out > hi))
        return fail(e, 400, key, "'%s' must be in [%lld, %lld], got %lld", key, (long long)lo,
                    (long long)hi, (long long)*out);
    return 0;
}

/* d in the fewest significant digits that read back as d: a refused
 * 1.0000001 is not reported as "got 1". */
static const char *shortest(double d, char *buf, size_t n) {
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, n, "%.*g", prec, d);
        if (strtod(buf, NULL) == d)
            break;
    }
    return buf;
}

/* A finite number in [lo, hi] (lo_open: lo excluded). */
static int get_num_range(const json_t *o, const char *key, double lo, bool lo_open, double hi,
                         float *out, gw_oai_err *e) {
    json_t *v = field(o, key);
    if (!v)
        return 0;
    if (!json_is_number(v))
        return fail(e, 400, key, "'%s' must be a number", key);
    double d = json_number_value(v);
    char got[32];
    if (!isfinite(d) || (lo_open ? d <= lo : d < lo) || d > hi)
        return fail(e, 400, key, "'%s' must be in %c%g, %g], got %s", key, lo_open ? '(' : '[', lo,
                    hi, shortest(d, got, sizeof got));
    /* The replicas sample in 32-bit floats: a value in an open range that
     * rounds to its bound there (top_p 1e-46 is 0) would be refused by the
     * replica, after the request was admitted (model/sampler.c). */
    float f = (float)d;
    if (lo_open && !(f > lo))
        return fail(e, 400, key, "'%s' must be in (%g, %g], got %s, which is %g as a 32-bit float", key,
                    lo, hi, shortest(d, got, sizeof got), (double)f);
    *out = f;
    return 0;
}

/* ---- chat messages -------------------------------------------------- */

typedef struct {
    pd_chat_message *msgs;
    int n;
    char **owned; /* strings built here (joined parts, tool-call arguments) */
    int n_owned, cap_owned;
    pd_tok_tool_call *calls;
} chat_msgs;

static char *own(chat_msgs *cm, char *s) {
    if (cm->n_owned == cm->cap_owned) {
        cm->cap_owned = cm->cap_owned ? 2 * cm->cap_owned : 16;
        cm->owned = realloc(cm->owned, (size_t)cm->cap_owned * sizeof *cm->owned);
        if (!cm->owned)
            abort();
    }
    cm->owned[cm->n_owned++] = s;
    return s;
}

static void chat_msgs_free(chat_msgs *cm) {
    for (int i = 0; i < cm->n_owned; i++)
        free(cm->owned[i]);
    free(cm->owned);
    free(cm->msgs);
    free(cm->calls);
}

/* content: a string, or an array of {"type":"text","text":...} parts
 * (joined with "\n", as vLLM does for text-only models). *out NULL when
 * absent or null. */
static int chat_content(chat_msgs *cm, const json_t *m, int i, const char **out, gw_oai_err *e) {
    char param[64];
    snprintf(param, sizeof param, "messages[%d].content", i);
    json_t *c = field(m, "content");
    *out = NULL;
    if (!c)
        return 0;
    if (json_is_string(c)) {
        *out = json_string_value(c);
        return 0;
    }
    if (!json_is_array(c))
        return fail(e, 400, param, "'%s' must be a string or an array of content parts", param);
    size_t total = 0, k;
    json_t *part;
    json_array_foreach(c, k, part) {
        char pp[96];
        snprintf(pp, sizeof pp, "%s[%zu]", param, k);
        json_t *type = json_object_get(part, "type");
        if (!json_is_object(part) || !json_is_string(type))
            return fail(e, 400, pp, "'%s' must be an object with a string 'type'", pp);
        if (strcmp(json_string_value(type), "text") != 0)
            return fail(e, 400, pp, "content part type '%s' is not supported (only 'text')",
                        json_string_value(type));
        json_t *text = json_object_get(part, "text");
        if (!json_is_string(text))
            return fail(e, 400, pp, "'%s.text' must be a string", pp);
        total += json_string_length(text) + 1;
    }
    char *joined = own(cm, pd_xmalloc(total + 1));
    size_t off = 0;
    json_array_foreach(c, k, part) {
        json_t *text = json_object_get(part, "text");
        if (k)
            joined[off++] = '\n';
        memcpy(joined + off, json_string_value(text), json_string_length(text));
        off += json_string_length(text);
    }
    joined[off] = 0;
    *out = joined;
    return 0;
}

static int chat_tool_calls(chat_msgs *cm, const json_t *m, int i, pd_chat_message *msg,
                           int *call_base, gw_oai_err *e) {
    json_t *tc = field(m, "tool_calls");
    if (!tc)
        return 0;
    char param[64];
    snprintf(param, sizeof param, "messages[%d].tool_calls", i);
    if (!json_is_array(tc))
        return fail(e, 400, param, "'%s' must be an array", param);
    size_t k;
    json_t *call;
    msg->tool_calls = cm->calls + *call_base;
    json_array_foreach(tc, k, call) {
        char pp[96];
        snprintf(pp, sizeof pp, "%s[%zu]", param, k);
        json_t *fn = json_object_get(call, "function");
        json_t *name = json_object_get(fn, "name");
        json_t *args = json_object_get(fn, "arguments");
        json_t *type = json_object_get(call, "type");
        if (!json_is_object(call) || !json_is_object(fn) || !json_is_string(name))
            return fail(e, 400, pp,
                        "'%s' must be {\"type\":\"function\",\"function\":{\"name\","
                        "\"arguments\"}}",
                        pp);
        if (type && !json_is_null(type) &&
            (!json_is_string(type) || strcmp(json_string_value(type), "function") != 0))
            return fail(e, 400, pp, "'%s.type' must be \"function\"", pp);
        pd_tok_tool_call *out = &cm->calls[(*call_base)++];
        out->type = "function";
        out->name = json_string_value(name);
        if (json_is_string(args))
            out->arguments = json_string_value(args);
        else if (!args || json_is_null(args))
            out->arguments = "{}";
        else /* some clients send the arguments as an object */
            out->arguments = own(cm, gw_json_dump(args));
        msg->n_tool_calls++;
    }
    return 0;
}

static int parse_messages(const json_t *root, chat_msgs *cm, gw_oai_err *e) {
    json_t *ms = json_object_get(root, "messages");
    if (!ms || json_is_null(ms))
        return fail(e, 400, "messages", "'messages' is required");
    if (!json_is_array(ms) || json_array_size(ms) == 0)
        return fail(e, 400, "messages", "'messages' must be a non-empty array");
    size_t n = json_array_size(ms), n_calls = 0, i;
    json_t *m;
    json_array_foreach(ms, i, m) {
        json_t *tc = json_object_get(m, "tool_calls");
        if (json_is_array(tc))
            n_calls += json_array_size(tc);
    }
    cm->msgs = pd_xcalloc(n, sizeof *cm->msgs);
    cm->calls = pd_xcalloc(n_calls ? n_calls : 1, sizeof *cm->calls);
    int call_base = 0;
    json_array_foreach(ms, i, m) {
        char param[64];
        snprintf(param, sizeof param, "messages[%zu]", i);
        if (!json_is_object(m))
            return fail(e, 400, param, "'%s' must be an object", param);
        json_t *role = json_object_get(m, "role");
        snprintf(param, sizeof param, "messages[%zu].role", i);
        if (!json_is_string(role))
            return fail(e, 400, param, "'%s' is required and must be a string", param);
        const char *r = json_string_value(role);
        pd_chat_message *msg = &cm->msgs[cm->n];
        if (strcmp(r, "system") == 0 || strcmp(r, "developer") == 0)
            msg->role = "system";
        else if (strcmp(r, "user") == 0 || strcmp(r, "assistant") == 0 || strcmp(r, "tool") == 0)
            msg->role = r;
        else
            return fail(e, 400, param,
                        "'%s' must be one of system, developer, user, assistant, tool; got '%.40s'",
                        param, r);
        if (chat_content(cm, m, (int)i, &msg->content, e))
            return -1;
        if (strcmp(msg->role, "assistant") == 0) {
            if (chat_tool_calls(cm, m, (int)i, msg, &call_base, e))
                return -1;
            /* The template renders tool calls only when content is none;
             * an assistant turn with neither renders as empty text. */
            if (!msg->content && msg->n_tool_calls == 0)
                msg->content = "";
            if (msg->content && msg->n_tool_calls > 0 && msg->content[0] == 0)
                msg->content = NULL;
        } else if (!msg->content) {
            snprintf(param, sizeof param, "messages[%zu].content", i);
            return fail(e, 400, param, "'%s' is required for role '%s'", param, r);
        }
        cm->n++;
    }
    return 0;
}

/* ---- tools, tool_choice, thinking ------------------------------------ */

/* OpenAI's rule for function names: 1-64 of [a-zA-Z0-9_-]. */
static bool valid_tool_name(const char *s, size_t len) {
    if (len == 0 || len > GW_MAX_TOOL_NAME_LEN || strlen(s) != len)
        return false;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-'))
            return false;
    }
    return true;
}

static int parse_tool_choice(const json_t *root, gw_oai_req *out, gw_oai_err *e) {
    json_t *tc = field(root, "tool_choice");
    out->tool_choice = out->n_tools ? GW_TOOLS_AUTO : GW_TOOLS_NONE;
    if (!tc)
        return 0;
    static const char shape[] = "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                "{\"type\": \"function\", \"function\": {\"name\": \"...\"}}";
    if (json_is_string(tc)) {
        const char *v = json_string_value(tc);
        if (strcmp(v, "none") == 0)
            out->tool_choice = GW_TOOLS_NONE;
        else if (strcmp(v, "auto") == 0)
            out->tool_choice = GW_TOOLS_AUTO;
        else if (strcmp(v, "required") == 0)
            out->tool_choice = GW_TOOLS_REQUIRED;
        else
            return fail(e, 400, "tool_choice", "%s; got \"%.40s\"", shape, v);
    } else if (json_is_object(tc)) {
        json_t *type = json_object_get(tc, "type");
        json_t *name = json_object_get(json_object_get(tc, "function"), "name");
        if (!json_is_string(type) || strcmp(json_string_value(type), "function") != 0 ||
            !json_is_string(name))
            return fail(e, 400, "tool_choice", "%s", shape);
        int k = -1;
        for (int i = 0; i < out->n_tools; i++)
            if (strcmp(out->tool_names[i], json_string_value(name)) == 0)
                k = i;
        if (k < 0)
            return fail(e, 400, "tool_choice",
                        "'tool_choice' names the function '%.64s', which is not in 'tools'",
                        json_string_value(name));
        out->tool_choice = GW_TOOLS_NAMED;
        out->tool_choice_name = pd_xstrdup(out->tool_names[k]);
    } else {
        return fail(e, 400, "tool_choice", "%s", shape);
    }
    if (out->n_tools == 0 && out->tool_choice != GW_TOOLS_NONE)
        return fail(e, 400, "tool_choice", "'tool_choice' is only allowed when 'tools' is given");
    return 0;
}

/* The canonical text of schema compiled by the grammar, or NULL when it
 * is outside the supported subset (or memory is short). */
static char *tool_schema(const json_t *schema) {
    char *text = json_dumps(schema, JSON_COMPACT);
    pd_grammar *g = NULL;
    pd_err err = {{0}};
    char *canon = NULL;
    if (text && pd_grammar_compile(text, strlen(text), &g, &err) == PD_OK)
        canon = strdup(pd_grammar_canonical(g));
    pd_grammar_free(&g);
    free(text);
    return canon;
}

/* tool_choice "required" / named under constrained decoding (the grammar,
 * as vLLM's guided decoding does): named, the output is the function's
 * arguments (its parameters schema; {"type": "object"} when that schema is
 * outside the grammar's subset); required, a non-empty array of
 * {"name", "parameters"} (with one tool its parameters schema, with several
 * the names as an enum and parameters any object: the grammar's anyOf needs
 * alternatives of different types). The gateway turns that JSON into the
 * calls (gw_request.c calls_from_json). */
static int constrain_tool_choice(const json_t *tools, gw_oai_req *out, gw_oai_err *e) {
    if (out->tool_choice != GW_TOOLS_REQUIRED && out->tool_choice != GW_TOOLS_NAMED)
        return 0;
    if (out->json_schema)
        return fail(e, 400, "tool_choice",
                    "'tool_choice' \"required\" or a named function cannot be combined with a "
                    "JSON 'response_format'");
    json_t *obj = json_pack("{s:s}", "type", "object");
    json_t *params = NULL;
    if (out->tool_choice == GW_TOOLS_NAMED || out->n_tools == 1) {
        const char *want = out->tool_choice == GW_TOOLS_NAMED ? out->tool_choice_name
                                                              : out->tool_names[0];
        size_t i;
        json_t *t;
        json_array_foreach(tools, i, t) {
            json_t *fn = json_object_get(t, "function");
            if (strcmp(json_string_value(json_object_get(fn, "name")), want) == 0)
                params = field(fn, "parameters");
        }
    }
    json_t *schema;
    if (out->tool_choice == GW_TOOLS_NAMED) {
        schema = json_incref(params ? params : obj);
    } else {
        json_t *names = json_array();
        for (int i = 0; i < out->n_tools; i++)
            json_array_append_new(names, json_string(out->tool_names[i]));
        schema = json_pack("{s:s, s:i, s:{s:s, s:{s:{s:o}, s:O}, s:[s, s]}}", "type", "array",
                           "minItems", 1, "items", "type", "object", "properties", "name", "enum",
                           names, "parameters", params ? params : obj, "required", "name",
                           "parameters");
    }
    out->json_schema = schema ? tool_schema(schema) : NULL;
    if (!out->json_schema && out->tool_choice == GW_TOOLS_NAMED)
        out->json_schema = tool_schema(obj);
    if (!out->json_schema && out->tool_choice == GW_TOOLS_REQUIRED && params) {
        json_decref(schema); /* parameters outside the subset: any object */
        json_t *names = json_array();
        for (int i = 0; i < out->n_tools; i++)
            json_array_append_new(names, json_string(out->tool_names[i]));
        schema = json_pack("{s:s, s:i, s:{s:s, s:{s:{s:o}, s:O}, s:[s, s]}}", "type", "array",
                           "minItems", 1, "items", "type", "object", "properties", "name", "enum",
                           names, "parameters", obj, "required", "name", "parameters");
        out->json_schema = schema ? tool_schema(schema) : NULL;
    }
    json_decref(schema);
    json_decref(obj);
    if (!out->json_schema)
        PD_LOGW(GW_MOD, "tool_choice: no constraint could be built; the output is not constrained");
    return 0;
}

/* tools (validated; names kept in out) and tool_choice; *section_p: the
 * tool section of the prompt (heap) or NULL without tools. The tools are
 * rendered also under tool_choice "none", as vLLM does. */
static int parse_tools(const pd_gw_config *cfg, const json_t *root, gw_oai_req *out,
                       char **section_p, gw_oai_err *e) {
    *section_p = NULL;
    json_t *tools = field(root, "tools");
    size_t n = 0;
    if (tools) {
        if (!json_is_array(tools))
            return fail(e, 400, "tools", "'tools' must be an array of function tools");
        n = json_array_size(tools);
        if (n > GW_MAX_TOOLS)
            return fail(e, 400, "tools", "at most %d tools are allowed, got %zu", GW_MAX_TOOLS, n);
    }
    bool ptc = true;
    if (get_bool(root, "parallel_tool_calls", &ptc, e))
        return -1;
    out->tool_names = pd_xcalloc(n ? n : 1, sizeof *out->tool_names);
    pd_chat_tool *defs = pd_xcalloc(n ? n : 1, sizeof *defs);
    int rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        char pp[80];
        json_t *t = json_array_get(tools, i);
        json_t *type = json_object_get(t, "type");
        json_t *fn = json_object_get(t, "function");
        json_t *name = json_object_get(fn, "name");
        json_t *desc = field(fn, "description");
        json_t *params = field(fn, "parameters");
        if (!json_is_object(t)) {
            snprintf(pp, sizeof pp, "tools[%zu]", i);
            rc = fail(e, 400, pp, "'%s' must be an object", pp);
        } else if (!json_is_string(type) || strcmp(json_string_value(type), "function") != 0) {
            snprintf(pp, sizeof pp, "tools[%zu].type", i);
            rc = fail(e, 400, pp, "'%s' must be \"function\"", pp);
        } else if (!json_is_object(fn)) {
            snprintf(pp, sizeof pp, "tools[%zu].function", i);
            rc = fail(e, 400, pp, "'%s' is required and must be an object", pp);
        } else if (!json_is_string(name) ||
                   !valid_tool_name(json_string_value(name), json_string_length(name))) {
            snprintf(pp, sizeof pp, "tools[%zu].function.name", i);
            rc = fail(e, 400, pp, "'%s' must be a string of 1 to %d characters a-z, A-Z, 0-9, _ or -",
                      pp, GW_MAX_TOOL_NAME_LEN);
        } else if (desc && !json_is_string(desc)) {
            snprintf(pp, sizeof pp, "tools[%zu].function.description", i);
            rc = fail(e, 400, pp, "'%s' must be a string", pp);
        } else if (params && !json_is_object(params)) {
            snprintf(pp, sizeof pp, "tools[%zu].function.parameters", i);
            rc = fail(e, 400, pp, "'%s' must be a JSON Schema object", pp);
        } else {
            for (int k = 0; k < out->n_tools && rc == 0; k++)
                if (strcmp(out->tool_names[k], json_string_value(name)) == 0) {
                    snprintf(pp, sizeof pp, "tools[%zu].function.name", i);
                    rc = fail(e, 400, pp, "'%s': the name '%s' is used by two tools", pp,
                              json_string_value(name));
                }
            if (rc)
                break;
            out->tool_names[out->n_tools++] = pd_xstrdup(json_string_value(name));
            defs[i].name = json_string_value(name);
            defs[i].description = desc ? json_string_value(desc) : NULL;
            /* as Jinja's tojson / Python's json.dumps: ", " and ": ", ASCII */
            defs[i].parameters = params ? json_dumps(params, JSON_ENSURE_ASCII) : NULL;
        }
    }
    if (rc == 0)
        rc = parse_tool_choice(root, out, e);
    if (rc == 0)
        rc = constrain_tool_choice(tools, out, e);
    if (rc == 0 && n > 0) {
        pd_err err;
        if (pd_chat_tools_prompt(defs, (int)n, cfg->tool_call_parser, section_p, &err) != PD_OK)
            rc = fail(e, 500, NULL, "cannot render the tools: %s", err.msg);
    }
    for (size_t i = 0; i < n; i++)
        free((char *)defs[i].parameters);
    free(defs);
    return rc;
}

/* Thinking mode: chat_template_kwargs.thinking (vLLM / SGLang's switch for
 * DeepSeek-V3.1; enable_thinking accepted as another name), else
 * reasoning_effort: "low" → off, "medium" / "high" → on (DeepSeek's
 * encodings have no effort levels, only the switch). -1: neither given. */
static int parse_thinking(const json_t *root, int *thinking, gw_oai_err *e) {
    *thinking = -1;
    json_t *re = field(root, "reasoning_effort");
    if (re) {
        const char *v = json_is_string(re) ? json_string_value(re) : "";
        if (strcmp(v, "low") == 0)
            *thinking = 0;
        else if (strcmp(v, "medium") == 0 || strcmp(v, "high") == 0)
            *thinking = 1;
        else
            return fail(e, 400, "reasoning_effort",
                        "'reasoning_effort' must be one of \"low\", \"medium\", \"high\"");
    }
    json_t *kw = field(root, "chat_template_kwargs");
    if (kw) {
        if (!json_is_object(kw))
            return fail(e, 400, "chat_template_kwargs", "'chat_template_kwargs' must be an object");
        const char *key = "thinking";
        json_t *th = field(kw, key);
        if (!th) {
            key = "enable_thinking";
            th = field(kw, key);
        }
        if (th) {
            if (!json_is_boolean(th))
                return fail(e, 400,
                            strcmp(key, "thinking") == 0 ? "chat_template_kwargs.thinking"
                                                         : "chat_template_kwargs.enable_thinking",
                            "'chat_template_kwargs.%s' must be a boolean", key);
            *thinking = json_is_true(th);
        }
    }
    return 0;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && memcmp(s + n - m, suffix, m) == 0;
}

/* ---- completions prompt ---------------------------------------------- */

static int parse_prompt_ids(const json_t *arr, int vocab, int32_t **ids_p, int *n_p,
                            gw_oai_err *e) {
    size_t n = json_array_size(arr), i;
    if (n == 0)
        return fail(e, 400, "prompt", "'prompt' must not be empty");
    if (n > (size_t)INT32_MAX / 2)
        return fail(e, 400, "prompt", "'prompt' is too long");
    int32_t *ids = malloc(n * sizeof *ids);
    if (!ids)
        return fail(e, 500, NULL, "out of memory");
    json_t *v;
    json_array_foreach(arr, i, v) {
        int64_t id;
        if (!as_int64(v, &id) || id < 0 || id >= vocab) {
            free(ids);
            return fail(e, 400, "prompt",
                        "'prompt' token ids must be integers in [0, %d); element %zu is not", vocab,
                        i);
        }
        ids[i] = (int32_t)id;
    }
    *ids_p = ids;
    *n_p = (int)n;
    return 0;
}

/* Encodes the prompt text (add_bos: BOS first). A text too long for
 * --max-model-len whatever it encodes to (every token stands for at most
 * pd_tok_max_token_bytes bytes) is refused before it is encoded: encoding
 * costs ~1 s a MB, which a 32 MB body would otherwise hold a tokenizer
 * worker for. */
static int tokenize(const pd_gw_config *cfg, gw_kind kind, const pd_tokenizer *tok,
                    const char *text, size_t len, bool add_bos, gw_oai_req *out, gw_oai_err *e) {
    size_t m = pd_tok_max_token_bytes(tok);
    if (m > 0 && cfg->max_model_len > 0 && len / m >= (size_t)cfg->max_model_len) {
        const char *what = kind == GW_KIND_CHAT ? "messages" : "prompt";
        return fail(e, 400, what,
                    "This model's maximum context length is %d tokens. However, your %s %s at "
                    "least %zu tokens (%zu bytes; no token is longer than %zu bytes), which leaves "
                    "no room for a completion. Please reduce the length of the %s.",
                    cfg->max_model_len, what, kind == GW_KIND_CHAT ? "have" : "has",
                    (len + m - 1) / m, len, m, what);
    }
    int32_t *ids = NULL;
    size_t n = 0;
    pd_err err;
    if (pd_tok_encode(tok, text, len, true, &ids, &n, &err) != PD_OK)
        return fail(e, 500, NULL, "tokenization failed: %s", err.msg);
    int32_t bos = add_bos ? pd_tok_find(tok, PD_TOK_DSV3_BOS) : -1;
    int extra = bos >= 0 ? 1 : 0;
    if (n + (size_t)extra > (size_t)INT32_MAX / 2) {
        free(ids);
        return fail(e, 400, NULL, "the prompt is too long");
    }
    int32_t *all = malloc((n + (size_t)extra + 1) * sizeof *all);
    if (!all) {
        free(ids);
        return fail(e, 500, NULL, "out of memory");
    }
    if (extra)
        all[0] = bos;
    if (n)
        memcpy(all + extra, ids, n * sizeof *ids);
    free(ids);
    out->prompt_ids = all;
    out->n_prompt = (int)n + extra;
    out->prompt_bos_added = extra > 0;
    return 0;
}

/* prompt: a string (BOS is prepended: add_bos_token is true for DeepSeek-V3),
 * token ids, or a one-element batch of either. */
static int parse_prompt(const pd_gw_config *cfg, const pd_tokenizer *tok, const json_t *root,
                        gw_oai_req *out, gw_oai_err *e) {
    json_t *p = json_object_get(root, "prompt");
    if (!p || json_is_null(p))
        return fail(e, 400, "prompt", "'prompt' is required");
    if (json_is_array(p) && json_array_size(p) >= 1) {
        json_t *first = json_array_get(p, 0);
        if (json_is_string(first) || json_is_array(first)) {
            if (json_array_size(p) > 1)
                return fail(e, 400, "prompt",
                            "batched prompts are not supported; send one request per prompt");
            p = first;
        }
    }
    if (json_is_string(p)) {
        const char *s = json_string_value(p);
        size_t len = json_string_length(p);
        if (tokenize(cfg, GW_KIND_COMPLETION, tok, s, len, true, out, e))
            return -1;
        if (out->echo) {
            out->echo_text = pd_xmalloc(len + 1);
            memcpy(out->echo_text, s, len + 1);
            out->echo_len = len;
        }
        return 0;
    }
    if (json_is_array(p)) {
        if (parse_prompt_ids(p, cfg->vocab_size, &out->prompt_ids, &out->n_prompt, e))
            return -1;
        out->prompt_from_ids = true;
        if (out->echo) {
            pd_err err;
            if (pd_tok_decode(tok, out->prompt_ids, (size_t)out->n_prompt, out->skip_special,
                              &out->echo_text, &out->echo_len, &err) != PD_OK)
                return fail(e, 500, NULL, "cannot decode the prompt: %s", err.msg);
        }
        return 0;
    }
    return fail(e, 400, "prompt", "'prompt' must be a string or an array of token ids");
}

/* ---- stop, stop_token_ids -------------------------------------------- */

static int parse_stop(const pd_gw_config *cfg, const json_t *root, gw_oai_req *out, gw_oai_err *e) {
    json_t *st = field(root, "stop");
    if (st) {
        size_t n = json_is_string(st) ? 1 : json_is_array(st) ? json_array_size(st) : 0;
        if (!json_is_string(st) && !json_is_array(st))
            return fail(e, 400, "stop", "'stop' must be a string or an array of strings");
        if (n > (size_t)cfg->max_stop_strings)
            return fail(e, 400, "stop",
                        "at most %d stop strings are allowed (--max-stop-strings), "
                        "got %zu",
                        cfg->max_stop_strings, n);
        out->stop = pd_xcalloc(n ? n : 1, sizeof *out->stop);
        for (size_t i = 0; i < n; i++) {
            json_t *s = json_is_string(st) ? st : json_array_get(st, i);
            if (!json_is_string(s))
                return fail(e, 400, "stop", "'stop' entries must be strings");
            if (json_string_length(s) == 0 || strlen(json_string_value(s)) == 0)
                return fail(e, 400, "stop", "'stop' strings must not be empty");
            out->stop[out->n_stop++] = pd_xstrdup(json_string_value(s));
        }
    }
    json_t *ids = field(root, "stop_token_ids");
    if (ids) {
        if (!json_is_array(ids))
            return fail(e, 400, "stop_token_ids", "'stop_token_ids' must be an array of integers");
        size_t n = json_array_size(ids), i;
        out->stop_token_ids = pd_xcalloc(n ? n : 1, sizeof *out->stop_token_ids);
        json_t *v;
        json_array_foreach(ids, i, v) {
            int64_t id;
            if (!as_int64(v, &id) || id < 0 || id >= cfg->vocab_size)
                return fail(e, 400, "stop_token_ids",
                            "'stop_token_ids' must hold token ids in [0, %d)", cfg->vocab_size);
            out->stop_token_ids[out->n_stop_token_ids++] = (int32_t)id;
        }
    }
    return 0;
}

/* ---- logit_bias ------------------------------------------------------- */

/* A token id written as a decimal string: optional '+' or '-', then digits
 * (int() of the key, as vLLM and OpenAI read it, without the whitespace). */
static bool parse_token_key(const char *k, int64_t *out) {
    const char *p = k;
    bool neg = *p == '-';
    if (*p == '-' || *p == '+')
        p++;
    if (!*p)
        return false;
    int64_t v = 0;
    for (; *p; p++) {
        if (*p < '0' || *p > '9')
            return false;
        if (v <= INT32_MAX) /* past that it stays there: outside any vocabulary */
            v = v * 10 + (*p - '0');
    }
    *out = neg ? -v : v;
    return true;
}

/* logit_bias: {"<token id>": bias}. Each id must be in [0, vocab_size) and
 * given once ("5" and "05" are the same token), each bias a number in
 * [-100, 100]; at most PD_MAX_LOGIT_BIAS entries. Fills out->logit_bias*
 * and points out->sampling at them. */
static int parse_logit_bias(const pd_gw_config *cfg, const json_t *root, gw_oai_req *out,
                            gw_oai_err *e) {
    json_t *lb = field(root, "logit_bias");
    if (!lb)
        return 0;
    if (!json_is_object(lb))
        return fail(e, 400, "logit_bias",
                    "'logit_bias' must be an object mapping token ids (as strings) to a bias in "
                    "[-100, 100]");
    size_t n = json_object_size(lb);
    if (n > PD_MAX_LOGIT_BIAS)
        return fail(e, 400, "logit_bias", "'logit_bias' has %zu entries; at most %d are allowed", n,
                    PD_MAX_LOGIT_BIAS);
    if (n == 0)
        return 0;
    out->logit_bias_ids = pd_xcalloc(n, sizeof *out->logit_bias_ids);
    out->logit_bias = pd_xcalloc(n, sizeof *out->logit_bias);
    const char *key;
    json_t *v;
    json_object_foreach(lb, key, v) {
        int64_t id;
        if (!parse_token_key(key, &id))
            return fail(e, 400, "logit_bias",
                        "'logit_bias' keys must be token ids (integers as strings), got '%.40s'",
                        key);
        if (id < 0 || id >= cfg->vocab_size)
            return fail(e, 400, "logit_bias",
                        "'logit_bias' token id %.40s is outside the vocabulary (size %d: ids 0 to "
                        "%d)",
                        key, cfg->vocab_size, cfg->vocab_size - 1);
        if (!json_is_number(v))
            return fail(e, 400, "logit_bias", "'logit_bias' of token %lld must be a number",
                        (long long)id);
        double d = json_number_value(v);
        char got[32];
        if (!(d >= -PD_MAX_LOGIT_BIAS_VALUE && d <= PD_MAX_LOGIT_BIAS_VALUE))
            return fail(e, 400, "logit_bias",
                        "'logit_bias' of token %lld must be in [-100, 100], got %s", (long long)id,
                        shortest(d, got, sizeof got));
        for (int i = 0; i < out->n_logit_bias; i++)
            if (out->logit_bias_ids[i] == (int32_t)id)
                return fail(e, 400, "logit_bias", "'logit_bias' gives token %lld twice",
                            (long long)id);
        out->logit_bias_ids[out->n_logit_bias] = (int32_t)id;
        out->logit_bias[out->n_logit_bias++] = (float)d;
    }
    out->sampling.logit_bias_ids = out->logit_bias_ids;
    out->sampling.logit_bias = out->logit_bias;
    out->sampling.n_logit_bias = out->n_logit_bias;
    return 0;
}

/* ---- the request ------------------------------------------------------ */

/* After "too big integer": which known integer field holds it. */
static const char *find_big_int(const char *body, size_t len) {
    static const char *const keys[] = {
        "seed",     "max_tokens",   "max_completion_tokens", "n",      "top_k",      "min_tokens",
        "logprobs", "top_logprobs", "stop_token_ids",        "prompt", "logit_bias", "tokens"};
    json_t *root = json_loadb(body, len, JSON_DECODE_INT_AS_REAL, NULL);
    if (!json_is_object(root)) {
        json_decref(root);
        return NULL;
    }
    const char *found = NULL;
    for (size_t k = 0; k < sizeof keys / sizeof *keys && !found; k++) {
        json_t *v = json_object_get(root, keys[k]);
        if (json_is_real(v) && fabs(json_real_value(v)) >= 9223372036854775807.0)
            found = keys[k];
        size_t i;
        json_t *x;
        if (json_is_array(v))
            json_array_foreach(v, i, x) {
                if (json_is_real(x) && fabs(json_real_value(x)) >= 9223372036854775807.0)
                    found = keys[k];
            }
        const char *name;
        if (json_is_object(v))
            json_object_foreach(v, name, x) {
                if (json_is_real(x) && fabs(json_real_value(x)) >= 9223372036854775807.0)
                    found = keys[k];
            }
    }
    json_decref(root);
    return found;
}

static int parse_sampling(const pd_gw_config *cfg, const pd_tokenizer *tok, const json_t *root,
                          gw_oai_req *out, gw_oai_err *e) {
    pd_sampling_params *sp = &out->sampling;
    *sp = pd_sampling_defaults();
    /* ids the tokenizer cannot spell (the model's padding rows) are never
     * drawn: every generated token has text */
    int tv = pd_tok_vocab_size(tok);
    sp->text_vocab_size = tv > 0 && tv < cfg->vocab_size ? tv : 0;
    if (get_num_range(root, "temperature", 0, false, 2, &sp->temperature, e))
        return -1;
    if (get_num_range(root, "top_p", 0, true, 1, &sp->top_p, e))
        return -1;
    int64_t top_k = -1;
    if (get_int_range(root, "top_k", -1, INT32_MAX, &top_k, NULL, e))
        return -1;
    sp->top_k = (int)top_k;
    if (get_num_range(root, "min_p", 0, false, 1, &sp->min_p, e))
        return -1;
    if (get_num_range(root, "presence_penalty", -2, false, 2, &sp->presence_penalty, e))
        return -1;
    if (get_num_range(root, "frequency_penalty", -2, false, 2, &sp->frequency_penalty, e))
        return -1;
    /* at least 1e-30: a positive logit divided by less overflows a 32-bit
     * float (1e-45 gave inf logits and garbage, a walkthrough found) */
    if (get_num_range(root, "repetition_penalty", 1e-30, false, 1e9, &sp->repetition_penalty, e))
        return -1;
    int64_t seed = 0;
    bool has_seed = false;
    if (get_int(root, "seed", &seed, &has_seed, e))
        return -1;
    sp->has_seed = has_seed;
    sp->seed = (uint64_t)seed;
    return 0;
}

static int parse_logprobs(const pd_gw_config *cfg, gw_kind kind, const json_t *root,
                          gw_oai_req *out, gw_oai_err *e) {
    out->logprobs = -1;
    int64_t v = 0;
    bool have = false;
    if (kind == GW_KIND_CHAT) {
        bool lp = false;
        if (get_bool(root, "logprobs", &lp, e))
            return -1;
        if (get_int_range(root, "top_logprobs", 0, cfg->max_logprobs, &v, &have, e))
            return -1;
        if (have && !lp)
            return fail(e, 400, "top_logprobs", "'top_logprobs' requires 'logprobs': true");
        if (lp)
            out->logprobs = (int)v;
    } else {
        if (get_int_range(root, "logprobs", 0, cfg->max_logprobs, &v, &have, e))
            return -1;
        if (have)
            out->logprobs = (int)v;
    }
    return 0;
}

/* response_format (OpenAI): {"type": "text"} (no constraint),
 * {"type": "json_object"} (any JSON object) or {"type": "json_schema",
 * "json_schema": {"name": ..., "schema": {...}, "strict": ...}}. The schema
 * is compiled here once to refuse what the replicas could not enforce
 * (grammar/pd_grammar.h: the supported subset and limits); the replicas get
 * its canonical text. */
static int parse_response_format(const json_t *root, gw_oai_req *out, gw_oai_err *e) {
    json_t *rf = field(root, "response_format");
    if (!rf)
        return 0;
    if (!json_is_object(rf))
        return fail(e, 400, "response_format", "'response_format' must be an object");
    json_t *type = json_object_get(rf, "type");
    if (!json_is_string(type))
        return fail(e, 400, "response_format.type",
                    "'response_format.type' is required and must be a string");
    const char *t = json_string_value(type);
    char *schema_text = NULL;
    if (strcmp(t, "text") == 0)
        return 0;
    if (strcmp(t, "json_object") == 0) {
        schema_text = strdup(PD_GRAMMAR_JSON_OBJECT);
    } else if (strcmp(t, "json_schema") == 0) {
        json_t *js = json_object_get(rf, "json_schema");
        if (!json_is_object(js))
            return fail(e, 400, "response_format.json_schema",
                        "'response_format.json_schema' is required and must be an object");
        json_t *name = json_object_get(js, "name");
        if (!json_is_string(name) || json_string_length(name) < 1 || json_string_length(name) > 64 ||
            strspn(json_string_value(name),
                   "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-") !=
                json_string_length(name))
            return fail(e, 400, "response_format.json_schema.name",
                        "'response_format.json_schema.name' is required: 1 to 64 of a-z, A-Z, "
                        "0-9, _ and -");
        json_t *strict = json_object_get(js, "strict");
        if (strict && !json_is_null(strict) && !json_is_boolean(strict))
            return fail(e, 400, "response_format.json_schema.strict",
                        "'response_format.json_schema.strict' must be a boolean");
        json_t *schema = json_object_get(js, "schema");
        if (!schema || json_is_null(schema))
            return fail(e, 400, "response_format.json_schema.schema",
                        "'response_format.json_schema.schema' is required");
        if (!json_is_object(schema) && !json_is_boolean(schema))
            return fail(e, 400, "response_format.json_schema.schema",
                        "'response_format.json_schema.schema' must be a JSON Schema object");
        schema_text = json_dumps(schema, JSON_COMPACT | JSON_ENCODE_ANY);
    } else {
        return fail(e, 400, "response_format.type",
                    "'response_format.type' must be one of text, json_object, json_schema; got "
                    "'%.64s'",
                    t);
    }
    if (!schema_text)
        return fail(e, 500, NULL, "out of memory");
    pd_grammar *g = NULL;
    pd_err err = {{0}};
    pd_status st = pd_grammar_compile(schema_text, strlen(schema_text), &g, &err);
    free(schema_text);
    if (st != PD_OK)
        return fail(e, 400, "response_format.json_schema.schema",
                    "'response_format.json_schema.schema': %s", err.msg);
    out->json_schema = strdup(pd_grammar_canonical(g));
    pd_grammar_free(&g);
    if (!out->json_schema)
        return fail(e, 500, NULL, "out of memory");
    return 0;
}

/* The prompt's length (out->n_prompt tokens) against --max-model-len L. A
 * prompt of L tokens or more leaves no room for the one token every request
 * generates (an echo-only request too), so no max_tokens could help: 400
 * naming the prompt ("messages" for chat), its length and L, as vLLM does.
 * Else an explicit max_tokens (MAX_KEY: "max_tokens", or chat's
 * "max_completion_tokens") beyond L - P is 400 naming MAX_KEY; without one,
 * out->max_tokens is what is left, at most 16 for completions (the OpenAI
 * API's and vLLM's default for /v1/completions: CompletionRequest.max_tokens
 * in vllm/entrypoints/openai/protocol.py) and at most
 * cfg->default_max_tokens for chat (0: no cap, as vLLM's chat). */
static int check_length(const pd_gw_config *cfg, gw_kind kind, bool explicit_max,
                        const char *max_key, int64_t max_tokens, gw_oai_req *out, gw_oai_err *e) {
    const char *what = kind == GW_KIND_CHAT ? "messages" : "prompt";
    int64_t L = cfg->max_model_len, P = out->n_prompt;
    if (P >= L)
        return fail(e, 400, what,
                    "This model's maximum context length is %lld tokens. However, your %s %s "
                    "%lld tokens, which leaves no room for a completion. Please reduce the "
                    "length of the %s.",
                    (long long)L, what, kind == GW_KIND_CHAT ? "have" : "has", (long long)P, what);
    if (explicit_max) {
        /* max_tokens may be any int64: compare without forming P + max_tokens */
        if (max_tokens > L - P)
            return fail(e, 400, max_key,
                        "This model's maximum context length is %lld tokens. However, you "
                        "requested %llu tokens (%lld in the %s, %lld for the completion: "
                        "%s). Please reduce the length of the %s or %s.",
                        (long long)L, /* the sum of two int64 >= 0 fits a uint64: exact, never capped */
                        (unsigned long long)P + (unsigned long long)max_tokens, (long long)P, what,
                        (long long)max_tokens, max_key, what, max_key);
        out->max_tokens = (int)max_tokens;
        return 0;
    }
    int64_t left = L - P;
    int64_t cap =
        kind == GW_KIND_COMPLETION ? GW_COMPLETIONS_DEFAULT_MAX_TOKENS : cfg->default_max_tokens;
    out->max_tokens = (int)(cap > 0 && cap < left ? cap : left);
    return 0;
}

/* "model": absent, null or the served model name (else 404, as vLLM). */
static int check_model(const pd_gw_config *cfg, const json_t *root, gw_oai_err *e) {
    json_t *model = field(root, "model");
    if (model && !json_is_string(model))
        return fail(e, 400, "model", "'model' must be a string");
    if (model && strcmp(json_string_value(model), cfg->served_model_name) != 0)
        return fail(e, 404, "model", "The model `%.200s` does not exist.",
                    json_string_value(model));
    return 0;
}

/* The prompt text of a chat request: add_generation_prompt,
 * continue_final_message (refused when true), chat_template_kwargs /
 * thinking, tools and messages, rendered with the DeepSeek-V3 template (the
 * BOS text first). Sets out's tool and reasoning fields (tool_names,
 * tool_choice, parse_reasoning, think). *text_p: a heap string on success. */
static int chat_prompt_text(const pd_gw_config *cfg, const json_t *root, gw_oai_req *out,
                            char **text_p, gw_oai_err *e) {
    bool add_gen = true, cont = false;
    if (get_bool(root, "add_generation_prompt", &add_gen, e))
        return -1;
    if (get_bool(root, "continue_final_message", &cont, e))
        return -1;
    if (cont)
        return fail(e, 400, "continue_final_message", "'continue_final_message' is not supported");
    int thinking = -1;
    if (parse_thinking(root, &thinking, e))
        return -1;
    char *tool_section = NULL;
    if (parse_tools(cfg, root, out, &tool_section, e))
        return -1;
    chat_msgs cm = {0};
    if (parse_messages(root, &cm, e)) {
        chat_msgs_free(&cm);
        free(tool_section);
        return -1;
    }
    char *text = NULL;
    pd_err err;
    pd_chat_render_opts ro = {.add_generation_prompt = add_gen,
                              .bos_token = PD_TOK_DSV3_BOS,
                              .system_suffix = tool_section,
                              .thinking = thinking};
    pd_status rc = pd_chat_render_ex(cm.msgs, cm.n, &ro, &text, &err);
    chat_msgs_free(&cm);
    free(tool_section);
    if (rc != PD_OK)
        return fail(e, 400, "messages", "cannot render the chat: %s", err.msg);
    out->parse_reasoning = cfg->reasoning_parser != PD_CHAT_REASONING_NONE;
    out->think = ends_with(text, "<think>")    ? PD_CHAT_THINK_ON
                 : ends_with(text, "</think>") ? PD_CHAT_THINK_OFF
                                               : PD_CHAT_THINK_AUTO;
    *text_p = text;
    return 0;
}

static int prepare(const pd_gw_config *cfg, const pd_tokenizer *tok, gw_kind kind,
                   const json_t *root, gw_oai_req *out, gw_oai_err *e) {
    if (!json_is_object(root))
        return fail(e, 400, NULL, "the request body must be a JSON object");

    if (check_model(cfg, root, e))
        return -1;

    /* shape of the prompt first (cheap), tokenization last */
    if (kind == GW_KIND_CHAT) {
        json_t *ms = json_object_get(root, "messages");
        if (!ms || json_is_null(ms))
            return fail(e, 400, "messages", "'messages' is required");
        if (!json_is_array(ms) || json_array_size(ms) == 0)
            return fail(e, 400, "messages", "'messages' must be a non-empty array");
    } else {
        json_t *p = json_object_get(root, "prompt");
        if (!p || json_is_null(p))
            return fail(e, 400, "prompt", "'prompt' is required");
        if (!json_is_string(p) && !json_is_array(p))
            return fail(e, 400, "prompt", "'prompt' must be a string or an array of token ids");
    }

    if (get_bool(root, "stream", &out->stream, e))
        return -1;
    json_t *so = field(root, "stream_options");
    if (so) {
        if (!json_is_object(so))
            return fail(e, 400, "stream_options", "'stream_options' must be an object");
        if (!out->stream)
            return fail(e, 400, "stream_options",
                        "'stream_options' is only allowed when 'stream' is true");
        if (get_bool(so, "include_usage", &out->include_usage, e)) {
            snprintf(e->param, sizeof e->param, "stream_options.include_usage");
            return -1;
        }
        json_t *cu = field(so, "continuous_usage_stats");
        if (cu && !json_is_false(cu))
            return fail(e, 400, "stream_options.continuous_usage_stats",
                        "'stream_options.continuous_usage_stats' is not supported: usage comes in the last chunk "
                        "with 'include_usage'");
    }

    int64_t n = 1;
    if (get_int_range(root, "n", 1, GW_MAX_N, &n, NULL, e))
        return -1;
    out->n = (int)n;

    int64_t max_tokens = 0;
    bool explicit_max = false;
    const char *max_key = "max_tokens";
    if (kind == GW_KIND_CHAT && field(root, "max_completion_tokens"))
        max_key = "max_completion_tokens";
    if (get_int(root, max_key, &max_tokens, &explicit_max, e))
        return -1;
    /* 0: completions with echo only (checked below), the prompt alone */
    if (explicit_max && max_tokens < (kind == GW_KIND_COMPLETION ? 0 : 1))
        return fail(e, 400, max_key, "'%s' must be at least 1, got %lld", max_key,
                    (long long)max_tokens);
    if (kind == GW_KIND_CHAT && strcmp(max_key, "max_tokens") != 0) {
        /* max_completion_tokens wins; max_tokens is still checked in full,
         * so a request with an invalid value is refused whichever is used */
        int64_t ignored;
        bool ignored_given = false;
        if (get_int(root, "max_tokens", &ignored, &ignored_given, e))
            return -1;
        if (ignored_given && ignored < 1)
            return fail(e, 400, "max_tokens", "'max_tokens' must be at least 1, got %lld", (long long)ignored);
    }

    int64_t min_tokens = 0;
    if (get_int_range(root, "min_tokens", 0, INT32_MAX, &min_tokens, NULL, e))
        return -1;
    out->min_tokens = (int)min_tokens;

    if (parse_sampling(cfg, tok, root, out, e))
        return -1;
    if (parse_stop(cfg, root, out, e))
        return -1;
    if (parse_logit_bias(cfg, root, out, e))
        return -1;
    out->skip_special = true;
    if (get_bool(root, "ignore_eos", &out->ignore_eos, e))
        return -1;
    if (get_bool(root, "skip_special_tokens", &out->skip_special, e))
        return -1;
    if (get_bool(root, "include_stop_str_in_output", &out->include_stop_str, e))
        return -1;
    if (kind == GW_KIND_COMPLETION && get_bool(root, "echo", &out->echo, e))
        return -1;
    if (explicit_max && max_tokens == 0) {
        if (!out->echo)
            return fail(e, 400, max_key, "'max_tokens' must be at least 1, got 0 (0 only with 'echo': true)");
        if (min_tokens > 0)
            return fail(e, 400, "min_tokens", "'min_tokens' (%lld) must not exceed max_tokens (0)",
                        (long long)min_tokens);
        out->echo_only = true;
        max_tokens = 1; /* what the engine runs; the token is dropped */
    }
    if (parse_logprobs(cfg, kind, root, out, e))
        return -1;
    if (refuse_vllm_extras(kind, root, e))
        return -1;
    /* OpenAI completions' suffix (insertion) and best_of: not implemented;
     * refused rather than ignored (vLLM refuses suffix; best_of equal to n
     * asks for nothing more and is taken) */
    if (kind == GW_KIND_COMPLETION) {
        json_t *sfx = field(root, "suffix");
        if (sfx && !json_is_null(sfx) && !(json_is_string(sfx) && json_string_length(sfx) == 0))
            return fail(e, 400, "suffix", "'suffix' (insertion) is not supported");
        json_t *bo = field(root, "best_of");
        if (bo && !json_is_null(bo) && !(json_is_integer(bo) && (json_integer_value(bo) == 1 ||
                                                                  json_integer_value(bo) == out->n)))
            return fail(e, 400, "best_of", "'best_of' other than 1 or n is not supported: ask for n choices instead");
    }
    if (parse_response_format(root, out, e))
        return -1;

    if (kind == GW_KIND_CHAT) {
        char *text = NULL;
        if (chat_prompt_text(cfg, root, out, &text, e))
            return -1;
        if (out->json_schema && out->parse_reasoning && out->think == PD_CHAT_THINK_ON &&
            out->tool_choice != GW_TOOLS_REQUIRED && out->tool_choice != GW_TOOLS_NAMED) {
            /* the mask applies from the first token: the JSON would be the reasoning (the
             * tool_choice constraint is the tool-call code's to decide) */
            free(text);
            return fail(e, 400, "response_format",
                        "'response_format' with thinking on is not supported: the output would "
                        "be reasoning; turn thinking off (chat_template_kwargs.thinking: false)");
        }
        /* The rendered text starts with the BOS text: no second BOS. */
        int r = tokenize(cfg, kind, tok, text, strlen(text), false, out, e);
        free(text);
        if (r)
            return -1;
    } else {
        if (parse_prompt(cfg, tok, root, out, e))
            return -1;
    }

    if (check_length(cfg, kind, explicit_max, max_key, max_tokens, out, e))
        return -1;
    if (out->min_tokens > out->max_tokens)
        return fail(e, 400, "min_tokens", "'min_tokens' (%d) must not exceed max_tokens (%d)",
                    out->min_tokens, out->max_tokens);
    return 0;
}

/* The body as JSON, or NULL with *e filled (400: malformed, or an integer
 * beyond int64 with the field that holds it). */
static json_t *load_body(const char *body, size_t len, gw_oai_err *e) {
    json_error_t je;
    json_t *root = json_loadb(body, len, 0, &je);
    if (root)
        return root;
    if (strstr(je.text, "too big")) {
        const char *param = find_big_int(body, len);
        if (param)
            fail(e, 400, param, "'%s' is out of range (must fit in a signed 64-bit integer)",
                 param);
        else
            fail(e, 400, NULL, "an integer in the request is out of range");
        return NULL;
    }
    if (json_error_code(&je) == json_error_null_character ||
        json_error_code(&je) == json_error_null_byte_in_key) {
        /* valid JSON (RFC 8259 allows any escaped code point), but prompts,
         * messages and names are passed on as C strings */
        fail(e, 400, NULL,
             "the request body holds \\u0000 (U+0000, NUL) in a string (line %d, column %d): "
             "not supported",
             je.line, je.column);
        return NULL;
    }
    fail(e, 400, NULL, "malformed JSON in the request body: %s (line %d, column %d)", je.text,
         je.line, je.column);
    return NULL;
}

int gw_oai_prepare(const pd_gw_config *cfg, const pd_tokenizer *tok, gw_kind kind, const char *body,
                   size_t len, gw_oai_req *out, gw_oai_err *e) {
    memset(out, 0, sizeof *out);
    memset(e, 0, sizeof *e);
    out->kind = kind;
    json_t *root = load_body(body, len, e);
    if (!root)
        return -1;
    int rc = prepare(cfg, tok, kind, root, out, e);
    json_decref(root);
    if (rc)
        gw_oai_req_clear(out);
    return rc;
}

void gw_oai_req_clear(gw_oai_req *r) {
    for (int i = 0; i < r->n_stop; i++)
        free(r->stop[i]);
    free(r->stop);
    free(r->stop_token_ids);
    free(r->logit_bias_ids);
    free(r->logit_bias);
    free(r->prompt_ids);
    free(r->echo_text);
    for (int i = 0; i < r->n_tools; i++)
        free(r->tool_names[i]);
    free(r->tool_names);
    free(r->tool_choice_name);
    free(r->json_schema);
    memset(r, 0, sizeof *r);
}

/* ---- /tokenize, /detokenize (vLLM) ------------------------------------- */

/* POST /tokenize. vLLM's two shapes: {"prompt": text, "add_special_tokens"
 * (default true: BOS first)} or a chat request {"messages", ...,
 * "add_special_tokens" (default false: the template's BOS text is the BOS)};
 * "return_token_strs" adds each token's text as tokenizer.json spells it.
 * A text longer than any --max-model-len tokens can spell is refused before it
 * is encoded, as on the generation endpoints (tokenize); below that there is
 * no limit: max_model_len is in the answer for the client to compare. */
static json_t *tokenize_answer(const pd_gw_config *cfg, const pd_tokenizer *tok, const json_t *root,
                               gw_oai_err *e) {
    bool chat = field(root, "messages") != NULL;
    json_t *prompt = field(root, "prompt");
    if (!chat && !prompt) {
        fail(e, 400, "prompt", "'prompt' (a string) or 'messages' is required");
        return NULL;
    }
    if (!chat && !json_is_string(prompt)) {
        fail(e, 400, "prompt", "'prompt' must be a string");
        return NULL;
    }
    bool add_special = !chat, want_strs = false;
    if (get_bool(root, "add_special_tokens", &add_special, e) ||
        get_bool(root, "return_token_strs", &want_strs, e))
        return NULL;
    gw_oai_req scratch = {0};
    int rc;
    if (chat) {
        char *text = NULL;
        rc = chat_prompt_text(cfg, root, &scratch, &text, e);
        if (rc == 0)
            rc = tokenize(cfg, GW_KIND_CHAT, tok, text, strlen(text), add_special, &scratch, e);
        free(text);
    } else {
        rc = tokenize(cfg, GW_KIND_COMPLETION, tok, json_string_value(prompt),
                      json_string_length(prompt), add_special, &scratch, e);
    }
    if (rc) {
        gw_oai_req_clear(&scratch);
        return NULL;
    }
    json_t *ids = json_array(), *strs = want_strs ? json_array() : json_null();
    for (int i = 0; i < scratch.n_prompt; i++) {
        json_array_append_new(ids, json_integer(scratch.prompt_ids[i]));
        if (want_strs) {
            const char *t = pd_tok_token_text(tok, scratch.prompt_ids[i]);
            json_array_append_new(strs, gw_json_text(t ? t : "", t ? strlen(t) : 0));
        }
    }
    json_t *answer = json_pack("{s:i, s:i, s:o, s:o}", "count", scratch.n_prompt, "max_model_len",
                               cfg->max_model_len, "tokens", ids, "token_strs", strs);
    gw_oai_req_clear(&scratch);
    if (!answer)
        fail(e, 500, NULL, "out of memory");
    return answer;
}

/* POST /detokenize: {"tokens": [id, ...]} -> {"prompt": text}, special
 * tokens included (vLLM decodes with the tokenizer's defaults). Each id
 * must be in [0, vocab_size). */
static json_t *detokenize_answer(const pd_gw_config *cfg, const pd_tokenizer *tok,
                                 const json_t *root, gw_oai_err *e) {
    json_t *t = field(root, "tokens");
    if (!t) {
        fail(e, 400, "tokens", "'tokens' is required");
        return NULL;
    }
    if (!json_is_array(t)) {
        fail(e, 400, "tokens", "'tokens' must be an array of token ids");
        return NULL;
    }
    size_t n = json_array_size(t), i;
    int32_t *ids = pd_xcalloc(n ? n : 1, sizeof *ids);
    json_t *v;
    json_array_foreach(t, i, v) {
        int64_t id;
        if (!as_int64(v, &id)) {
            free(ids);
            fail(e, 400, "tokens", "'tokens[%zu]' must be an integer token id", i);
            return NULL;
        }
        if (id < 0 || id >= cfg->vocab_size) {
            free(ids);
            fail(e, 400, "tokens",
                 "'tokens[%zu]' = %lld is outside the vocabulary (size %d: ids 0 to %d)", i,
                 (long long)id, cfg->vocab_size, cfg->vocab_size - 1);
            return NULL;
        }
        ids[i] = (int32_t)id;
    }
    char *text = NULL;
    size_t len = 0;
    pd_err err;
    pd_status st = pd_tok_decode(tok, ids, n, false, &text, &len, &err);
    free(ids);
    if (st != PD_OK) {
        fail(e, 500, NULL, "cannot decode the tokens: %s", err.msg);
        return NULL;
    }
    json_t *answer = json_pack("{s:o}", "prompt", gw_json_text(text, len));
    free(text);
    if (!answer)
        fail(e, 500, NULL, "out of memory");
    return answer;
}

int gw_oai_tokenize(const pd_gw_config *cfg, const pd_tokenizer *tok, gw_kind kind,
                    const char *body, size_t len, char **resp_p, gw_oai_err *e) {
    memset(e, 0, sizeof *e);
    *resp_p = NULL;
    if (kind != GW_KIND_TOKENIZE && kind != GW_KIND_DETOKENIZE)
        return fail(e, 500, NULL, "gw_oai_tokenize: not a tokenize request");
    json_t *root = load_body(body, len, e);
    if (!root)
        return -1;
    json_t *answer = NULL;
    if (!json_is_object(root))
        fail(e, 400, NULL, "the request body must be a JSON object");
    else if (check_model(cfg, root, e) == 0)
        answer = kind == GW_KIND_TOKENIZE ? tokenize_answer(cfg, tok, root, e)
                                          : detokenize_answer(cfg, tok, root, e);
    json_decref(root);
    if (!answer)
        return -1;
    *resp_p = gw_json_dump(answer);
    json_decref(answer);
    return 0;
}
