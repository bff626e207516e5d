/* pd_gw_request: one POST /v1/completions or /v1/chat/completions from the
 * body to the last byte of the response.
 *
 *   begin ──▶ worker: parse, validate, render, tokenize ──▶ prepared
 *         ──▶ engine->submit ──▶ (stream: 200 + role chunk, pings)
 *         ──▶ pd_gw_on_tokens*: detokenize per choice, stop strings, deltas
 *         ──▶ pd_gw_on_finish per choice / pd_gw_on_error
 *         ──▶ complete (deferred): engine->abort if the engine still holds
 *             it, final JSON or usage chunk + [DONE], free.
 *
 * The engine is never called from inside its own callbacks, and the request
 * is never freed inside one: completion runs from an event (ev_complete).
 * A client that goes away (the stream's close callback) cancels the worker
 * job or aborts the engine, then frees the request at once.
 *
 * Output shapes follow the OpenAI API (and vLLM's extensions stop_reason):
 * chat.completion / chat.completion.chunk, text_completion. Streaming: for
 * chat a role chunk per choice first; content deltas; one final chunk per
 * choice carrying its finish_reason (null on all others); with
 * stream_options.include_usage one usage chunk (choices: []) before
 * "data: [DONE]" and "usage": null on every other chunk.
 *
 * Text and token counts agree (issue "Gateway completeness"): every token
 * the engine reports for a choice counts towards usage until the choice
 * ends, and a token that shows no text is accounted for on the choice's
 * final object: a special token skipped by skip_special_tokens counts in
 * "skipped_special_tokens" (present when > 0); a token of stop_token_ids
 * that ended the choice is "stop_reason" (an integer, as in vLLM) and shows
 * no text unless include_stop_str_in_output; a stop string is "stop_reason"
 * (a string), its text shown only with include_stop_str_in_output. So a 200
 * whose text is empty while completion_tokens > 0 always says why.
 *
 * Logs: every line about a request starts with its id ("cmpl-…" /
 * "chatcmpl-…", the response id and the engine's request_id); the line that
 * accepts the request also names the client's X-Request-Id when one came.
 */
#include <ctype.h>
#include <math.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "gw_internal.h"

typedef struct {
    int32_t id;
    float logprob;
    bool has;
    bool null_top; /* the first prompt token: top_logprobs null (nothing precedes it) */
    int n_top;     /* alternatives known for it, in the choice's top_ids / top_lps */
    int64_t off;   /* its text_offset: bytes of the choice's text (the echo included) before it */
} gw_tok_lp;

typedef struct {
    pd_detok *dt;
    gw_stopbuf sb;
    struct evbuffer *text; /* visible text not yet sent (stream) or all of it */
    int n_tokens;          /* counted for usage */
    bool finished;
    bool engine_finished; /* the engine reported on_finish for it (or abort_choice ran) */
    bool abort_pending;   /* ended on a stop string; abort_choice is due */
    const char *finish_reason;
    int stop_index;        /* matched stop string, or -1 */
    int32_t held_stop_id;  /* a stop_token_ids token not yet shown: it ends the choice if
                              on_finish("stop") comes next, else it is text; -1 none */
    int32_t stop_token;    /* the stop_token_ids token that ended the choice, or -1 */
    int n_skipped_special; /* special tokens that showed no text (skip_special_tokens) */
    gw_tok_lp *lp;         /* logprobs of tokens not yet sent (stream) or all */
    int n_lp, cap_lp;
    int32_t *top_ids; /* [cap_lp][r.logprobs]: the alternatives of lp[i] at i * r.logprobs */
    float *top_lps;
    size_t decoded;     /* bytes of text the detokenizer gave for the generated tokens so far */
    /* completions with echo and logprobs: the prompt tokens' logprobs as they
     * arrive (pd_gw_on_prompt_logprobs), [n_prompt], alternatives at
     * i * r.logprobs; moved in front of ch->lp at the first token */
    gw_tok_lp *plp;
    int32_t *plp_top_ids;
    float *plp_top_lps;
    bool prompt_shown;
    /* chat: reasoning and tool calls (chat/pd_chat.h) */
    pd_gw_request *req;
    pd_chat_parser *cp;         /* the parsers of this choice's text, or NULL */
    struct evbuffer *reasoning; /* reasoning not yet sent (stream) or all of it */
    struct evbuffer *held;      /* tool_choice required / named: content until the end */
    json_t *calls;              /* tool calls not yet sent (stream) or all: chunk objects */
    int n_calls;
} gw_choice;

struct pd_gw_request {
    gw_server *srv;
    pd_gw_request *prev, *next; /* srv->reqs: every live request (drain) */
    gw_stream *st; /* NULL once the client is gone */
    gw_job *job;   /* while the worker prepares it */
    gw_kind kind;
    gw_oai_req r;
    pd_gw_gen_params gp;
    char id[64];
    char xrid[136]; /* X-Request-Id */
    int64_t created;
    void *engine_data;
    bool submitted;   /* the engine accepted it */
    bool engine_done; /* the engine will not call back (finished, failed or aborted) */
    bool stopped;     /* stop strings ended every choice (pd_gw_request_stopped) */
    bool started;     /* the streamed response head went out */
    bool failed;
    bool in_cb;
    bool got_token;
    int err_status;
    char err_msg[512];
    int submit_status, retry_after;
    char submit_msg[256];
    gw_choice *ch;
    int n_unfinished;        /* choices not yet finished (gateway view) */
    int n_engine_unfinished; /* choices the engine has not finished */
    struct event *ev_complete;
    struct event *ev_ping;
    struct event *ev_abort_choice; /* runs srv->abort_choice for abort_pending choices */
};

static void req_complete_cb(evutil_socket_t fd, short what, void *arg);
static void req_ping_cb(evutil_socket_t fd, short what, void *arg);
static void emit_prompt(pd_gw_request *req, gw_choice *ch);

/* ---- small helpers ---------------------------------------------------- */

/* application/json, any case, with optional parameters; a charset other
 * than UTF-8 is refused. */
bool gw_is_json_content_type(const char *ct) {
    if (!ct)
        return false;
    while (*ct == ' ' || *ct == '\t')
        ct++;
    static const char want[] = "application/json";
    if (strncasecmp(ct, want, sizeof want - 1) != 0)
        return false;
    const char *p = ct + sizeof want - 1;
    while (*p == ' ' || *p == '\t')
        p++;
    if (*p == 0)
        return true;
    if (*p != ';')
        return false;
    while (*p == ';') {
        p++;
        while (*p == ' ' || *p == '\t')
            p++;
        const char *name = p;
        while (*p && *p != '=' && *p != ';')
            p++;
        size_t nlen = (size_t)(p - name);
        while (nlen && (name[nlen - 1] == ' ' || name[nlen - 1] == '\t'))
            nlen--;
        if (*p != '=')
            continue;
        p++;
        while (*p == ' ' || *p == '\t')
            p++;
        const char *val = p;
        bool quoted = *p == '"';
        if (quoted)
            val = ++p;
        while (*p && (quoted ? *p != '"' : (*p != ';' && *p != ' ' && *p != '\t')))
            p++;
        size_t vlen = (size_t)(p - val);
        if (quoted && *p == '"')
            p++;
        while (*p && *p != ';')
            p++;
        if (nlen == 7 && strncasecmp(name, "charset", 7) == 0 &&
            !((vlen == 5 && strncasecmp(val, "utf-8", 5) == 0) ||
              (vlen == 4 && strncasecmp(val, "utf8", 4) == 0)))
            return false;
    }
    return true;
}

/* Writes "data: <json>\n\n" as one write, so that each event is one HTTP
 * chunk (one h2 DATA frame later). */
static void sse_send_text(pd_gw_request *req, const char *s) {
    size_t n = strlen(s);
    char *ev = pd_xmalloc(n + 8);
    memcpy(ev, "data: ", 6);
    memcpy(ev + 6, s, n);
    memcpy(ev + 6 + n, "\n\n", 2);
    gw_stream_write(req->st, ev, n + 8);
    free(ev);
}

static void sse_send(pd_gw_request *req, json_t *j) {
    char *s = gw_json_dump(j);
    json_decref(j);
    sse_send_text(req, s);
    free(s);
}

static void sse_done(pd_gw_request *req) {
    static const char done[] = "data: [DONE]\n\n";
    gw_stream_write(req->st, done, sizeof done - 1);
}

static json_t *usage_json(const pd_gw_request *req) {
    json_int_t c = 0;
    for (int i = 0; i < req->gp.n; i++)
        c += req->ch[i].n_tokens;
    json_int_t p = req->r.n_prompt;
    return json_pack("{s:I, s:I, s:I}", "prompt_tokens", p, "completion_tokens", c, "total_tokens",
                     p + c);
}

static json_t *chunk_base(const pd_gw_request *req) {
    json_t *j = json_pack("{s:s, s:s, s:I, s:s}", "id", req->id, "object",
                          req->kind == GW_KIND_CHAT ? "chat.completion.chunk" : "text_completion",
                          "created", (json_int_t)req->created, "model", req->srv->model_name);
    return j;
}

/* The text of a token for logprobs output (its bytes, made valid UTF-8). */
static json_t *token_json(const pd_gw_request *req, int32_t id, json_t **bytes_p) {
    size_t len = 0;
    const char *b = pd_tok_token_bytes(req->srv->tok, id, &len);
    if (bytes_p) {
        *bytes_p = json_array();
        for (size_t i = 0; i < len; i++)
            json_array_append_new(*bytes_p, json_integer((unsigned char)b[i]));
    }
    return gw_json_text(b ? b : "", len);
}

/* A logprob as JSON: vLLM's max(logprob, -9999.0), which also makes -inf
 * (a masked token) and NaN valid JSON. */
static json_t *lp_json(float logprob) {
    double v = logprob;
    if (!(v >= -9999.0) || isinf(v))
        v = -9999.0;
    return json_real(v);
}

/* Chat: {token, logprob, bytes} of one token. */
static json_t *chat_lp_entry(const pd_gw_request *req, int32_t id, json_t *lp) {
    json_t *bytes;
    json_t *tok = token_json(req, id, &bytes);
    return json_pack("{s:o, s:o, s:o}", "token", tok, "logprob", lp, "bytes", bytes);
}

/* Completions: {token text: logprob} at one position: the alternatives and
 * the sampled token (OpenAI: "up to logprobs + 1" entries), best first (a
 * sampled token whose logprob the engine did not report: last, null); a
 * text that two ids share keeps its first (larger) logprob. null when
 * logprobs is 0 and nothing is known. */
static void completion_top_put(const pd_gw_request *req, json_t *d, int32_t id, json_t *lp) {
    json_t *tok = token_json(req, id, NULL);
    const char *key = json_string_value(tok);
    if (key && !json_object_get(d, key))
        json_object_set(d, key, lp);
    json_decref(tok);
    json_decref(lp);
}

static json_t *completion_top_json(const pd_gw_request *req, const gw_tok_lp *t, const int32_t *ids,
                                   const float *lps) {
    if (!t->has && t->n_top == 0 && req->r.logprobs == 0)
        return json_null();
    bool add_sampled = true;
    for (int j = 0; j < t->n_top; j++)
        if (ids[j] == t->id)
            add_sampled = false; /* listed already */
    json_t *d = json_object();
    for (int j = 0;;) {
        if (add_sampled &&
            (j == t->n_top ||
             (t->has && (t->logprob > lps[j] || (t->logprob == lps[j] && t->id < ids[j]))))) {
            completion_top_put(req, d, t->id, t->has ? lp_json(t->logprob) : json_null());
            add_sampled = false;
            continue;
        }
        if (j == t->n_top)
            break;
        completion_top_put(req, d, ids[j], lp_json(lps[j]));
        j++;
    }
    return d;
}

/* Logprobs of ch->lp[0..n_lp) in the shape of the endpoint, or null. Top
 * logprobs are the engine's alternatives (pd_gw_on_tokens_top); an engine
 * that reports none gets the sampled token alone there. */
static json_t *logprobs_json(pd_gw_request *req, gw_choice *ch) {
    if (req->r.logprobs < 0)
        return json_null();
    int k = req->r.logprobs;
    if (req->kind == GW_KIND_CHAT) {
        json_t *content = json_array();
        for (int i = 0; i < ch->n_lp; i++) {
            const gw_tok_lp *t = &ch->lp[i];
            json_t *lp = t->has ? lp_json(t->logprob) : json_null();
            json_t *top = json_array();
            for (int j = 0; j < t->n_top; j++)
                json_array_append_new(top, chat_lp_entry(req, ch->top_ids[(size_t)i * k + j],
                                                         lp_json(ch->top_lps[(size_t)i * k + j])));
            if (t->n_top == 0 && k > 0)
                json_array_append_new(top, chat_lp_entry(req, t->id, json_incref(lp)));
            json_t *e = chat_lp_entry(req, t->id, lp);
            json_object_set_new(e, "top_logprobs", top);
            json_array_append_new(content, e);
        }
        return json_pack("{s:o}", "content", content);
    }
    json_t *tokens = json_array(), *tlp = json_array(), *top = json_array(), *off = json_array();
    for (int i = 0; i < ch->n_lp; i++) {
        const gw_tok_lp *t = &ch->lp[i];
        json_array_append_new(tokens, token_json(req, t->id, NULL));
        json_array_append_new(tlp, t->has ? lp_json(t->logprob) : json_null());
        json_array_append_new(top, t->null_top ? json_null()
                                               : completion_top_json(req, t, k ? ch->top_ids + (size_t)i * k : NULL,
                                                                     k ? ch->top_lps + (size_t)i * k : NULL));
        json_array_append_new(off, json_integer((json_int_t)t->off));
    }
    return json_pack("{s:o, s:o, s:o, s:o}", "tokens", tokens, "token_logprobs", tlp,
                     "top_logprobs", top, "text_offset", off);
}

/* Takes the pending text of b as a JSON string. */
static json_t *take_buf(struct evbuffer *b) {
    size_t len = evbuffer_get_length(b);
    json_t *t = gw_json_text(len ? (const char *)evbuffer_pullup(b, -1) : "", len);
    evbuffer_drain(b, len);
    return t;
}

/* Takes the choice's pending text as a JSON string. */
static json_t *take_text(gw_choice *ch) {
    return take_buf(ch->text);
}

/* Something of choice ch waits to be streamed. */
static bool has_pending(const gw_choice *ch) {
    return evbuffer_get_length(ch->text) > 0 || ch->n_lp > 0 ||
           (ch->reasoning && evbuffer_get_length(ch->reasoning) > 0) ||
           (ch->calls && json_array_size(ch->calls) > 0);
}

/* vLLM's stop_reason: the stop string, the stop token id, or null (EOS,
 * length, or an engine reason). */
static json_t *stop_reason_json(const pd_gw_request *req, const gw_choice *ch) {
    if (ch->stop_index >= 0)
        return json_string(req->r.stop[ch->stop_index]);
    if (ch->stop_token >= 0)
        return json_integer(ch->stop_token);
    return json_null();
}

/* The fields that end a choice object: finish_reason, stop_reason and the
 * count of special tokens that showed no text (when any). */
static void set_final_fields(const pd_gw_request *req, const gw_choice *ch, json_t *c) {
    json_object_set_new(c, "finish_reason", json_string(ch->finish_reason));
    json_object_set_new(c, "stop_reason", stop_reason_json(req, ch));
    if (ch->n_skipped_special > 0)
        json_object_set_new(c, "skipped_special_tokens", json_integer(ch->n_skipped_special));
}

/* Stream: one chunk for choice i with its pending text; finish_reason set
 * on the choice's last chunk. */
static void send_choice_chunk(pd_gw_request *req, int i, bool final) {
    gw_choice *ch = &req->ch[i];
    json_t *c = json_pack("{s:i}", "index", i);
    if (req->kind == GW_KIND_CHAT) {
        json_t *delta = json_object();
        if (ch->reasoning && evbuffer_get_length(ch->reasoning)) {
            json_t *t = take_buf(ch->reasoning);
            json_object_set(delta, "reasoning_content", t);
            json_object_set_new(delta, "reasoning", t);
        }
        if (evbuffer_get_length(ch->text) || (!final && json_object_size(delta) == 0 &&
                                               !(ch->calls && json_array_size(ch->calls))))
            json_object_set_new(delta, "content", take_text(ch));
        if (ch->calls && json_array_size(ch->calls)) {
            json_object_set_new(delta, "tool_calls", json_copy(ch->calls));
            json_array_clear(ch->calls);
        }
        json_object_set_new(c, "delta", delta);
    } else {
        json_object_set_new(c, "text", take_text(ch));
    }
    json_object_set_new(c, "logprobs", logprobs_json(req, ch));
    ch->n_lp = 0;
    if (final)
        set_final_fields(req, ch, c);
    else
        json_object_set_new(c, "finish_reason", json_null());
    json_t *j = chunk_base(req);
    json_t *choices = json_array();
    json_array_append_new(choices, c);
    json_object_set_new(j, "choices", choices);
    if (req->r.include_usage)
        json_object_set_new(j, "usage", json_null());
    sse_send(req, j);
}

static void schedule_complete(pd_gw_request *req) {
    event_active(req->ev_complete, 0, 0);
}

/* ---- text of a choice --------------------------------------------------- */

/* A tool call of choice ch as a streamed tool_calls[] entry (the
 * non-streamed message drops "index"). id: "call_" + 24 random hex digits. */
static void add_call(gw_choice *ch, const char *name, const char *arguments) {
    char id[48];
    pd_rng *rng = &ch->req->srv->rng;
    unsigned long long a = pd_rng_next(rng), b = pd_rng_next(rng);
    snprintf(id, sizeof id, "call_%016llx%08llx", a, b & 0xffffffffull);
    json_t *c = json_pack("{s:i, s:s, s:s, s:{s:s, s:s}}", "index", ch->n_calls, "id", id, "type",
                          "function", "function", "name", name, "arguments", arguments);
    if (!c) { /* not UTF-8: the parser checked both, so not expected */
        PD_LOGE(GW_MOD, "%s: tool call '%.64s' cannot be encoded; dropped", ch->req->id, name);
        return;
    }
    json_array_append_new(ch->calls, c);
    ch->n_calls++;
}

static void on_chat_event(void *ud, const pd_chat_event *ev) {
    gw_choice *ch = ud;
    if (ev->kind == PD_CHAT_EV_REASONING)
        evbuffer_add(ch->reasoning, ev->text, ev->len);
    else if (ev->kind == PD_CHAT_EV_CONTENT)
        evbuffer_add(ch->held ? ch->held : ch->text, ev->text, ev->len);
    else
        add_call(ch, ev->name, ev->arguments);
}

/* Appends final text of a choice (through its parsers, when it has them). */
static void emit(gw_choice *ch, const char *s, size_t len) {
    if (!len)
        return;
    if (!ch->cp) {
        evbuffer_add(ch->text, s, len);
    } else if (pd_chat_parser_feed(ch->cp, s, len) != PD_OK) {
        PD_LOGE(GW_MOD, "%s: out of memory parsing the output", ch->req->id);
        abort();
    }
}

/* tool_choice required / named without a call in the model's format: the
 * content as vLLM's guided output would be: named, the arguments object;
 * required, [{"name": …, "parameters": {…}}, …] with known names. Else the
 * content stays text. */
static void calls_from_json(pd_gw_request *req, gw_choice *ch) {
    size_t len = evbuffer_get_length(ch->held);
    json_t *j = json_loadb(len ? (const char *)evbuffer_pullup(ch->held, -1) : "", len, 0, NULL);
    const gw_oai_req *r = &req->r;
    bool ok = false;
    if (r->tool_choice == GW_TOOLS_NAMED && json_is_object(j)) {
        char *args = json_dumps(j, JSON_COMPACT);
        if (args)
            add_call(ch, r->tool_choice_name, args);
        free(args);
        ok = args != NULL;
    } else if (r->tool_choice == GW_TOOLS_REQUIRED && json_is_array(j) && json_array_size(j) > 0) {
        size_t i;
        json_t *c;
        ok = true;
        json_array_foreach(j, i, c) {
            json_t *name = json_object_get(c, "name");
            bool known = false;
            for (int k = 0; json_is_string(name) && k < r->n_tools; k++)
                known |= strcmp(r->tool_names[k], json_string_value(name)) == 0;
            if (!known || !json_is_object(json_object_get(c, "parameters")))
                ok = false;
        }
        json_array_foreach(j, i, c) {
            char *args = ok ? json_dumps(json_object_get(c, "parameters"), JSON_COMPACT) : NULL;
            if (args)
                add_call(ch, json_string_value(json_object_get(c, "name")), args);
            free(args);
        }
    }
    json_decref(j);
    if (ok)
        evbuffer_drain(ch->held, len);
}

/* The output of choice ch ended: what its parsers held comes out. */
static void chat_finish(pd_gw_request *req, gw_choice *ch) {
    if (!ch->cp)
        return;
    if (pd_chat_parser_finish(ch->cp) != PD_OK) {
        PD_LOGE(GW_MOD, "%s: out of memory parsing the output", req->id);
        abort();
    }
    if (ch->held) {
        if (ch->n_calls == 0)
            calls_from_json(req, ch);
        evbuffer_add_buffer(ch->text, ch->held);
    }
}

/* Feeds detokenized text through the stop strings. Returns true when a stop
 * string matched (the choice is then over). */
static bool feed_text(pd_gw_request *req, gw_choice *ch, const char *s, size_t len, bool final) {
    const gw_oai_req *r = &req->r;
    if (r->n_stop == 0 || ch->n_tokens < r->min_tokens) {
        if (ch->sb.len) {
            emit(ch, ch->sb.buf, ch->sb.len);
            gw_stopbuf_consume(&ch->sb, ch->sb.len);
        }
        emit(ch, s, len);
        return false;
    }
    size_t n = 0;
    int m = gw_stop_feed(&ch->sb, s, len, r->stop, r->n_stop, r->include_stop_str, final, &n);
    if (m == -2) {
        PD_LOGE(GW_MOD, "%s: out of memory holding stop-string text", req->id);
        abort();
    }
    emit(ch, ch->sb.buf, n);
    gw_stopbuf_consume(&ch->sb, m >= 0 ? ch->sb.len : n);
    if (m >= 0)
        ch->stop_index = m;
    return m >= 0;
}

static void finish_choice(pd_gw_request *req, int i, const char *reason) {
    gw_choice *ch = &req->ch[i];
    emit_prompt(req, ch); /* no token came (max_tokens 0, or a failure) */
    chat_finish(req, ch);
    if (ch->n_calls > 0 && strcmp(reason, "stop") == 0)
        reason = "tool_calls"; /* as vLLM: the output ended in tool calls */
    ch->finished = true;
    ch->finish_reason = reason;
    req->n_unfinished--;
    size_t shown = evbuffer_get_length(ch->text); /* not yet sent: all of it when not streamed */
    if (!req->r.stream && shown == 0 && ch->n_tokens > 0 && ch->stop_index < 0 &&
        ch->stop_token < 0 && ch->n_skipped_special == 0 && !(req->r.echo && req->r.echo_len) &&
        ch->n_calls == 0 && !(ch->reasoning && evbuffer_get_length(ch->reasoning)))
        PD_LOGW(GW_MOD, "%s: choice %d: %d tokens and no text, with no reason", req->id, i,
                ch->n_tokens);
    if (req->r.stream && req->st)
        send_choice_chunk(req, i, true);
    if (req->n_unfinished == 0) {
        schedule_complete(req);
    } else if (!ch->engine_finished && req->srv->abort_choice) {
        ch->abort_pending = true; /* the engine is still generating it for nothing */
        event_active(req->ev_abort_choice, 0, 0);
    }
}

static bool is_stop_token(const pd_gw_request *req, int32_t id) {
    for (int i = 0; i < req->r.n_stop_token_ids; i++)
        if (req->r.stop_token_ids[i] == id)
            return true;
    return false;
}

/* Detokenizes one token of ch into its text. Returns true when a stop
 * string matched. */
static bool push_token(pd_gw_request *req, gw_choice *ch, int32_t id) {
    if (req->r.skip_special && pd_tok_is_special(req->srv->tok, id))
        ch->n_skipped_special++;
    const char *piece;
    size_t len;
    pd_detok_push(ch->dt, id, &piece, &len);
    ch->decoded += len;
    return feed_text(req, ch, piece, len, false);
}

/* ---- the engine's calls ------------------------------------------------- */

/* Appends one token's logprob and its n_top (<= r.logprobs) alternatives to
 * ch->lp / ch->top_*, and its text_offset as a generated token's (the bytes
 * the detokenizer gave before it: a token whose bytes are not valid UTF-8
 * counts the U+FFFD the text shows, one that completes no character yet
 * counts none). Alternatives at -inf (tokens a grammar or the vocabulary
 * mask forbids; the engine lists them last) are dropped: docs/api.md. */
static void keep_logprobs(pd_gw_request *req, gw_choice *ch, int32_t id, const float *logprob,
                          const int32_t *top_ids, const float *top_lps, int n_top) {
    size_t k = (size_t)req->r.logprobs;
    while (n_top > 0 && !(top_lps[n_top - 1] > -INFINITY))
        n_top--;
    if (ch->n_lp == ch->cap_lp) {
        ch->cap_lp = ch->cap_lp ? 2 * ch->cap_lp : 16;
        ch->lp = realloc(ch->lp, (size_t)ch->cap_lp * sizeof *ch->lp);
        if (!ch->lp)
            abort();
        if (k > 0) {
            ch->top_ids = realloc(ch->top_ids, (size_t)ch->cap_lp * k * sizeof *ch->top_ids);
            ch->top_lps = realloc(ch->top_lps, (size_t)ch->cap_lp * k * sizeof *ch->top_lps);
            if (!ch->top_ids || !ch->top_lps)
                abort();
        }
    }
    if (n_top > 0) {
        memcpy(ch->top_ids + (size_t)ch->n_lp * k, top_ids, (size_t)n_top * sizeof *top_ids);
        memcpy(ch->top_lps + (size_t)ch->n_lp * k, top_lps, (size_t)n_top * sizeof *top_lps);
    }
    ch->lp[ch->n_lp++] = (gw_tok_lp){.id = id, .logprob = logprob ? *logprob : 0, .has = logprob != NULL,
                                     .n_top = n_top,
                                     .off = (int64_t)((req->r.echo ? req->r.echo_len : 0) + ch->decoded)};
}

/* Completions with echo and logprobs: the prompt tokens lead the choice's
 * logprobs, once, before its first token (or at its end when none came):
 * position 0 null (token_logprobs and top_logprobs, as vLLM / OpenAI), the
 * others as reported. A streamed choice also gets the echoed text here (the
 * response head left it out), in the chunk of its first token. text_offset
 * of a prompt token: bytes of the echoed text before it, so a BOS the
 * gateway added to a text prompt, and special tokens that the decoding of a
 * token-id prompt skipped, take no bytes. */
static void emit_prompt(pd_gw_request *req, gw_choice *ch) {
    if (!ch->plp || ch->prompt_shown)
        return;
    ch->prompt_shown = true;
    const gw_oai_req *r = &req->r;
    size_t k = (size_t)r->logprobs, off = 0;
    for (int i = 0; i < r->n_prompt; i++) {
        const gw_tok_lp *t = &ch->plp[i];
        keep_logprobs(req, ch, t->id, t->has ? &t->logprob : NULL, k ? ch->plp_top_ids + (size_t)i * k : NULL,
                      k ? ch->plp_top_lps + (size_t)i * k : NULL, t->n_top);
        gw_tok_lp *e = &ch->lp[ch->n_lp - 1];
        e->null_top = i == 0;
        e->off = (int64_t)off;
        bool shown = !(i == 0 && r->prompt_bos_added) &&
                     !(r->prompt_from_ids && r->skip_special && pd_tok_is_special(req->srv->tok, t->id));
        size_t blen = 0;
        pd_tok_token_bytes(req->srv->tok, t->id, &blen);
        if (shown)
            off += blen;
    }
    if (r->stream && r->echo_len)
        evbuffer_add(ch->text, r->echo_text, r->echo_len);
}

/* Completions with echo and logprobs: the engine reports the prompt's
 * logprobs (pd_gw_on_prompt_logprobs) and the response shows them. */
static bool wants_prompt_logprobs(const gw_oai_req *r) {
    return r->kind == GW_KIND_COMPLETION && r->echo && r->logprobs >= 0;
}

static bool bad_call(const pd_gw_request *req, int choice, const char *what) {
    if (!req) {
        PD_LOGE(GW_MOD, "%s: NULL request", what);
        return true;
    }
    if (req->engine_done) {
        PD_LOGE(GW_MOD, "%s: %s after the request ended for the engine", req->id, what);
        return true;
    }
    if (choice < 0 || choice >= req->gp.n) {
        PD_LOGE(GW_MOD, "%s: %s for choice %d of %d", req->id, what, choice, req->gp.n);
        return true;
    }
    return false;
}

void pd_gw_on_tokens(pd_gw_request *req, int choice, const int32_t *ids, const float *logprobs,
                     int n) {
    pd_gw_on_tokens_top(req, choice, ids, logprobs, NULL, NULL, 0, n);
}

void pd_gw_on_tokens_top(pd_gw_request *req, int choice, const int32_t *ids, const float *logprobs,
                         const int32_t *top_ids, const float *top_logprobs, int k, int n) {
    if (bad_call(req, choice, "on_tokens"))
        return;
    if (n < 1 || !ids) {
        PD_LOGE(GW_MOD, "%s: on_tokens with %d ids", req->id, n);
        return;
    }
    gw_choice *ch = &req->ch[choice];
    if (ch->finished)
        return; /* stopped by a stop string; the rest is discarded */
    emit_prompt(req, ch);
    if (req->r.echo_only) { /* max_tokens 0: the prompt alone; the engine's token is dropped */
        req->in_cb = true;
        finish_choice(req, choice, "length");
        req->in_cb = false;
        return;
    }
    /* alternatives: what the request asked for, of what the engine knows */
    int n_top = top_ids && top_logprobs && k > 0 ? k : 0;
    if (n_top > req->r.logprobs)
        n_top = req->r.logprobs > 0 ? req->r.logprobs : 0;
    req->in_cb = true;
    if (!req->got_token) {
        req->got_token = true;
        if (req->ev_ping)
            evtimer_del(req->ev_ping);
    }
    bool stopped = false;
    for (int i = 0; i < n && !stopped; i++) {
        if (ch->held_stop_id >= 0) { /* more came: it was not the last token, so it is text */
            int32_t held = ch->held_stop_id;
            ch->held_stop_id = -1;
            if (push_token(req, ch, held)) {
                stopped = true;
                break; /* ids[i] comes after the stop string: dropped, not counted */
            }
        }
        ch->n_tokens++;
        if (req->r.logprobs >= 0)
            keep_logprobs(req, ch, ids[i], logprobs ? &logprobs[i] : NULL,
                          n_top ? top_ids + (size_t)i * k : NULL,
                          n_top ? top_logprobs + (size_t)i * k : NULL, n_top);
        if (is_stop_token(req, ids[i])) {
            ch->held_stop_id = ids[i];
            continue;
        }
        stopped = push_token(req, ch, ids[i]);
    }
    if (stopped) {
        finish_choice(req, choice, "stop");
    } else if (req->r.stream && req->st && has_pending(ch)) {
        send_choice_chunk(req, choice, false);
    }
    req->in_cb = false;
}

void pd_gw_on_prompt_logprobs(pd_gw_request *req, int choice, int first, int n, const float *logprobs,
                              const int32_t *top_ids, const float *top_logprobs, int k) {
    if (bad_call(req, choice, "on_prompt_logprobs"))
        return;
    gw_choice *ch = &req->ch[choice];
    if (!ch->plp || ch->prompt_shown || ch->finished)
        return; /* not asked for, or too late to show */
    if (first < 1 || n < 1 || !logprobs || first > req->r.n_prompt - n) {
        PD_LOGE(GW_MOD, "%s: prompt logprobs of positions %d + %d outside 1..%d", req->id, first, n,
                req->r.n_prompt - 1);
        return;
    }
    int want = req->r.logprobs;
    int n_top = top_ids && top_logprobs && k > 0 ? (k < want ? k : want) : 0;
    for (int i = 0; i < n; i++) {
        size_t pos = (size_t)first + (size_t)i;
        gw_tok_lp *t = &ch->plp[pos];
        t->logprob = logprobs[i];
        t->has = true;
        t->n_top = n_top;
        if (n_top) {
            memcpy(ch->plp_top_ids + pos * (size_t)want, top_ids + (size_t)i * k, (size_t)n_top * sizeof *top_ids);
            memcpy(ch->plp_top_lps + pos * (size_t)want, top_logprobs + (size_t)i * k,
                   (size_t)n_top * sizeof *top_logprobs);
        }
    }
}

void pd_gw_on_finish(pd_gw_request *req, int choice, const char *finish_reason) {
    if (bad_call(req, choice, "on_finish"))
        return;
    gw_choice *ch = &req->ch[choice];
    if (ch->engine_finished) {
        PD_LOGE(GW_MOD, "%s: choice %d finished twice", req->id, choice);
        return;
    }
    req->in_cb = true;
    ch->engine_finished = true;
    if (--req->n_engine_unfinished == 0)
        req->engine_done = true;
    if (!ch->finished) {
        bool stop = !finish_reason || strcmp(finish_reason, "stop") == 0;
        bool stopped = false;
        if (ch->held_stop_id >= 0) {
            int32_t held = ch->held_stop_id;
            ch->held_stop_id = -1;
            if (stop)
                ch->stop_token = held; /* it ended the choice */
            if (!stop || req->r.include_stop_str)
                stopped = push_token(req, ch, held);
        }
        const char *piece;
        size_t len;
        pd_detok_flush(ch->dt, &piece, &len);
        if (!stopped)
            stopped = feed_text(req, ch, piece, len, true);
        if (stopped)
            ch->stop_token = -1; /* a stop string came first */
        const char *reason = "stop";
        if (!stopped) {
            if (finish_reason && strcmp(finish_reason, "length") == 0)
                reason = "length";
            else if (finish_reason && strcmp(finish_reason, "stop") != 0)
                reason = finish_reason; /* passed through (static strings expected) */
        }
        finish_choice(req, choice, reason);
    }
    req->in_cb = false;
}

void pd_gw_on_error(pd_gw_request *req, int http_status_if_not_started, const char *message) {
    if (!req)
        return;
    if (req->engine_done) {
        PD_LOGE(GW_MOD, "%s: on_error after the request ended for the engine", req->id);
        return;
    }
    req->engine_done = true;
    req->failed = true;
    int st = http_status_if_not_started;
    req->err_status = st >= 400 && st <= 599 ? st : 500;
    snprintf(req->err_msg, sizeof req->err_msg, "%s", message ? message : "generation failed");
    PD_LOGW(GW_MOD, "%s: engine error: %s", req->id, req->err_msg);
    schedule_complete(req);
}

void gw_requests_shut_down(gw_server *s) {
    for (pd_gw_request *req = s->reqs; req; req = req->next) {
        if (!req->submitted || req->engine_done)
            continue; /* still being prepared (pd_gw_server_free aborts it), or already ending */
        req->engine_done = true;
        req->srv->engine.abort(req->srv->engine_ctx, req); /* the replicas stop it */
        req->failed = true;
        req->err_status = 503;
        snprintf(req->err_msg, sizeof req->err_msg, "the server shut down before the request finished");
        PD_LOGW(GW_MOD, "%s: %s", req->id, req->err_msg);
        schedule_complete(req);
    }
}

void pd_gw_on_error_retry(pd_gw_request *req, int http_status_if_not_started, int retry_after_s,
                          const char *message) {
    if (req && !req->engine_done)
        req->retry_after = retry_after_s;
    pd_gw_on_error(req, http_status_if_not_started, message);
}

void pd_gw_submit_error(pd_gw_request *req, int http_status, int retry_after_s,
                        const char *message) {
    if (!req)
        return;
    req->submit_status = http_status;
    req->retry_after = retry_after_s;
    snprintf(req->submit_msg, sizeof req->submit_msg, "%s", message ? message : "");
}

const pd_gw_gen_params *pd_gw_request_params(const pd_gw_request *req) {
    return req ? &req->gp : NULL;
}

void pd_gw_request_set_engine_data(pd_gw_request *req, void *data) {
    if (req)
        req->engine_data = data;
}

void *pd_gw_request_engine_data(const pd_gw_request *req) {
    return req ? req->engine_data : NULL;
}

const char *pd_gw_request_choice_reason(const pd_gw_request *req, int choice) {
    if (!req || !req->ch || choice < 0 || choice >= req->gp.n || !req->ch[choice].finished)
        return NULL;
    return req->ch[choice].finish_reason;
}

bool pd_gw_request_stopped(const pd_gw_request *req) {
    return req && req->stopped;
}

/* ---- life cycle ---------------------------------------------------------- */

static void req_free(pd_gw_request *req) {
    if (req->prev)
        req->prev->next = req->next;
    else
        req->srv->reqs = req->next;
    if (req->next)
        req->next->prev = req->prev;
    gw_server_request_gone(req->srv);
    if (req->st)
        gw_stream_set_close_cb(req->st, NULL, NULL);
    if (req->job)
        gw_pool_cancel(req->job);
    if (req->ev_complete)
        event_free(req->ev_complete);
    if (req->ev_abort_choice)
        event_free(req->ev_abort_choice);
    if (req->ev_ping)
        event_free(req->ev_ping);
    for (int i = 0; req->ch && i < req->gp.n; i++) {
        pd_detok_free(&req->ch[i].dt);
        gw_stopbuf_free(&req->ch[i].sb);
        if (req->ch[i].text)
            evbuffer_free(req->ch[i].text);
        free(req->ch[i].lp);
        free(req->ch[i].top_ids);
        free(req->ch[i].top_lps);
        free(req->ch[i].plp);
        free(req->ch[i].plp_top_ids);
        free(req->ch[i].plp_top_lps);
        pd_chat_parser_free(&req->ch[i].cp);
        if (req->ch[i].reasoning)
            evbuffer_free(req->ch[i].reasoning);
        if (req->ch[i].held)
            evbuffer_free(req->ch[i].held);
        json_decref(req->ch[i].calls);
    }
    free(req->ch);
    gw_oai_req_clear(&req->r);
    free(req);
}

static void req_on_stream_close(gw_stream *st, void *ud) {
    pd_gw_request *req = ud;
    req->st = NULL;
    if (req->job) {
        gw_pool_cancel(req->job);
        req->job = NULL;
    }
    PD_LOGI(GW_MOD, "%s: client went away", req->id[0] ? req->id : "(preparing)");
    if (req->submitted && !req->engine_done) {
        req->engine_done = true;
        req->srv->engine.abort(req->srv->engine_ctx, req);
    }
    if (req->in_cb) { /* not expected: the stream closes from connection events */
        schedule_complete(req);
        return;
    }
    req_free(req);
}

static void respond_error(pd_gw_request *req, int status, const char *msg, const char *param,
                          int retry_after) {
    char ra[24];
    gw_hdr h[2];
    int n = 0;
    h[n++] = (gw_hdr){"X-Request-Id", req->xrid};
    if (retry_after > 0) {
        snprintf(ra, sizeof ra, "%d", retry_after);
        h[n++] = (gw_hdr){"Retry-After", ra};
    }
    gw_stream_respond_error(req->st, status, msg, param, h, n);
}

/* The whole non-streamed response. */
static void respond_full(pd_gw_request *req) {
    json_t *choices = json_array();
    for (int i = 0; i < req->gp.n; i++) {
        gw_choice *ch = &req->ch[i];
        json_t *c = json_pack("{s:i}", "index", i);
        if (req->kind == GW_KIND_CHAT) {
            json_t *msg = json_pack("{s:s}", "role", "assistant");
            bool calls = ch->calls && json_array_size(ch->calls) > 0;
            /* null, not "", when there is no answer text besides tool calls
             * (as OpenAI) or besides the reasoning (vLLM's reasoning parsers:
             * thinking cut by max_tokens, or nothing after </think>) */
            bool thought = ch->reasoning && evbuffer_get_length(ch->reasoning) > 0;
            if ((calls || thought) && evbuffer_get_length(ch->text) == 0)
                json_object_set_new(msg, "content", json_null());
            else
                json_object_set_new(msg, "content", take_text(ch));
            if (ch->reasoning) {
                json_t *t = evbuffer_get_length(ch->reasoning) ? take_buf(ch->reasoning)
                                                               : json_null();
                json_object_set(msg, "reasoning_content", t);
                json_object_set_new(msg, "reasoning", t);
            }
            if (calls) {
                size_t k;
                json_t *tc;
                json_array_foreach(ch->calls, k, tc) json_object_del(tc, "index");
                json_object_set(msg, "tool_calls", ch->calls);
            }
            json_object_set_new(c, "message", msg);
        } else {
            if (req->r.echo && req->r.echo_len)
                evbuffer_prepend(ch->text, req->r.echo_text, req->r.echo_len);
            json_object_set_new(c, "text", take_text(ch));
        }
        json_object_set_new(c, "logprobs", logprobs_json(req, ch));
        set_final_fields(req, ch, c);
        json_array_append_new(choices, c);
    }
    json_t *j = json_pack("{s:s, s:s, s:I, s:s, s:o, s:o}", "id", req->id, "object",
                          req->kind == GW_KIND_CHAT ? "chat.completion" : "text_completion",
                          "created", (json_int_t)req->created, "model", req->srv->model_name,
                          "choices", choices, "usage", usage_json(req));
    char *body = gw_json_dump(j);
    json_decref(j);
    gw_hdr h = {"X-Request-Id", req->xrid};
    gw_stream_respond(req->st, 200, "application/json", &h, 1, body, strlen(body));
    free(body);
}

static void req_complete_cb(evutil_socket_t fd, short what, void *arg) {
    pd_gw_request *req = arg;
    if (!req->engine_done) { /* stop strings ended every choice: release the engine */
        req->engine_done = true;
        req->stopped = true;
        req->srv->engine.abort(req->srv->engine_ctx, req);
    }
    if (req->st) {
        if (req->failed && !req->started) {
            /* 503: a transient failure (a replica, a KV transfer): retry after a
             * second, or what the engine estimated (pd_gw_on_error_retry) */
            respond_error(req, req->err_status, req->err_msg, NULL,
                          req->err_status != 503 ? 0 : req->retry_after > 0 ? req->retry_after : 1);
        } else if (req->failed) {
            /* after the 200: an in-band error event, then [DONE] */
            char *e = gw_error_json(req->err_status, req->err_msg, NULL);
            sse_send_text(req, e);
            free(e);
            sse_done(req);
            gw_stream_end(req->st);
        } else if (req->r.stream) {
            if (req->r.include_usage) {
                json_t *j = chunk_base(req);
                json_object_set_new(j, "choices", json_array());
                json_object_set_new(j, "usage", usage_json(req));
                sse_send(req, j);
            }
            sse_done(req);
            gw_stream_end(req->st);
        } else {
            respond_full(req);
        }
        req->st = NULL; /* ended: the protocol owns and frees it */
    }
    json_int_t c = 0;
    for (int i = 0; i < req->gp.n; i++)
        c += req->ch[i].n_tokens;
    PD_LOGD(GW_MOD, "%s: done, %d prompt + %lld completion tokens%s", req->id, req->r.n_prompt,
            (long long)c, req->failed ? " (failed)" : "");
    req_free(req);
}

/* Choices that ended on a stop string while others go on: tell the engine
 * (srv->abort_choice), from the loop rather than inside its callback. */
static void req_abort_choice_cb(evutil_socket_t fd, short what, void *arg) {
    pd_gw_request *req = arg;
    for (int i = 0; i < req->gp.n && !req->engine_done; i++) {
        gw_choice *ch = &req->ch[i];
        if (!ch->abort_pending || ch->engine_finished)
            continue;
        ch->abort_pending = false;
        if (req->n_engine_unfinished <= 1)
            break; /* the last one: the whole request ends, and abort covers it */
        ch->engine_finished = true;
        req->n_engine_unfinished--;
        PD_LOGD(GW_MOD, "%s: choice %d ended on a stop string; aborting it", req->id, i);
        req->srv->abort_choice(req->srv->engine_ctx, req, i);
    }
}

static void req_ping_cb(evutil_socket_t fd, short what, void *arg) {
    pd_gw_request *req = arg;
    if (req->st && req->started && !req->got_token) {
        static const char ping[] = ": ping\n\n";
        gw_stream_write(req->st, ping, sizeof ping - 1);
    }
}

/* Stream: the response head, the role chunk per choice (chat) or the echoed
 * prompt (completions), and the ping timer. */
static void start_stream(pd_gw_request *req) {
    gw_hdr h[3] = {
        {"Cache-Control", "no-cache"}, {"X-Request-Id", req->xrid}, {"X-Accel-Buffering", "no"}};
    gw_stream_start(req->st, 200, "text/event-stream; charset=utf-8", h, 3);
    req->started = true;
    for (int i = 0; i < req->gp.n; i++) {
        json_t *c;
        if (req->kind == GW_KIND_CHAT) {
            c = json_pack("{s:i, s:{s:s, s:s}, s:n, s:n}", "index", i, "delta", "role", "assistant",
                          "content", "", "logprobs", "finish_reason");
        } else if (req->r.echo && req->r.echo_len && !wants_prompt_logprobs(&req->r)) {
            c = json_pack("{s:i, s:o, s:n, s:n}", "index", i, "text",
                          gw_json_text(req->r.echo_text, req->r.echo_len), "logprobs",
                          "finish_reason");
        } else {
            continue;
        }
        json_t *j = chunk_base(req);
        json_t *choices = json_array();
        json_array_append_new(choices, c);
        json_object_set_new(j, "choices", choices);
        if (req->r.include_usage)
            json_object_set_new(j, "usage", json_null());
        sse_send(req, j);
    }
    double iv = req->srv->cfg.sse_ping_interval_s;
    if (iv > 0) {
        req->ev_ping = event_new(req->srv->base, -1, EV_PERSIST, req_ping_cb, req);
        struct timeval tv = gw_timeval(iv);
        if (req->ev_ping)
            evtimer_add(req->ev_ping, &tv);
    }
}

/* The parsers of a chat choice, when the request needs any. False when
 * memory is short. */
static bool chat_init(pd_gw_request *req, gw_choice *ch) {
    const gw_oai_req *r = &req->r;
    bool tools = r->tool_choice != GW_TOOLS_NONE;
    if (req->kind != GW_KIND_CHAT || (!r->parse_reasoning && !tools))
        return true;
    const char *const *names = (const char *const *)r->tool_names;
    int n_names = r->n_tools;
    if (r->tool_choice == GW_TOOLS_NAMED) {
        names = (const char *const *)&r->tool_choice_name;
        n_names = 1;
    }
    /* a constrained tool choice: the output is the JSON, from its first byte */
    bool constrained = (r->tool_choice == GW_TOOLS_REQUIRED || r->tool_choice == GW_TOOLS_NAMED) &&
                       r->json_schema;
    pd_chat_parser_opts o = {
        .think = r->parse_reasoning && !constrained ? r->think : PD_CHAT_THINK_OFF,
        .parse_tools = tools,
        .tool_parser = req->srv->cfg.tool_call_parser,
        .tool_names = names,
        .n_tool_names = n_names,
    };
    ch->cp = pd_chat_parser_new(&o, on_chat_event, ch);
    ch->calls = json_array();
    if (r->parse_reasoning)
        ch->reasoning = evbuffer_new();
    if (r->tool_choice == GW_TOOLS_REQUIRED || r->tool_choice == GW_TOOLS_NAMED)
        ch->held = evbuffer_new();
    return ch->cp && ch->calls && (!r->parse_reasoning || ch->reasoning) &&
           (!(r->tool_choice == GW_TOOLS_REQUIRED || r->tool_choice == GW_TOOLS_NAMED) || ch->held);
}

static void make_id(pd_gw_request *req) {
    gw_server *s = req->srv;
    snprintf(req->id, sizeof req->id, "%s-%016llx%016llx",
             req->kind == GW_KIND_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)pd_rng_next(&s->rng), (unsigned long long)pd_rng_next(&s->rng));
}

/* The worker is done with the body: refuse, or hand the request to the
 * engine. */
static void req_prepared(gw_job *job, void *ud) {
    pd_gw_request *req = ud;
    req->job = NULL;
    if (job->rc != 0) {
        PD_LOGD(GW_MOD, "%s: refused: %d %s (param %s)", req->id, job->err.status, job->err.message,
                job->err.param[0] ? job->err.param : "-");
        respond_error(req, job->err.status ? job->err.status : 400, job->err.message,
                      job->err.param, 0);
        req->st = NULL;
        gw_job_free(job);
        req_free(req);
        return;
    }
    req->r = job->req;
    memset(&job->req, 0, sizeof job->req);
    gw_job_free(job);

    gw_oai_req *r = &req->r;
    req->ev_complete = event_new(req->srv->base, -1, 0, req_complete_cb, req);
    req->ev_abort_choice = event_new(req->srv->base, -1, 0, req_abort_choice_cb, req);
    req->ch = calloc((size_t)r->n, sizeof *req->ch);
    bool ok = req->ev_complete && req->ev_abort_choice && req->ch;
    for (int i = 0; ok && i < r->n; i++) {
        req->ch[i].dt = pd_detok_new(req->srv->tok, r->skip_special);
        req->ch[i].text = evbuffer_new();
        req->ch[i].stop_index = -1;
        req->ch[i].held_stop_id = -1;
        req->ch[i].stop_token = -1;
        req->ch[i].req = req;
        ok = req->ch[i].dt && req->ch[i].text && chat_init(req, &req->ch[i]);
        if (ok && wants_prompt_logprobs(r)) {
            gw_choice *ch = &req->ch[i];
            size_t np = (size_t)r->n_prompt, k = (size_t)r->logprobs;
            ch->plp = calloc(np, sizeof *ch->plp);
            ch->plp_top_ids = k ? calloc(np * k, sizeof *ch->plp_top_ids) : NULL;
            ch->plp_top_lps = k ? calloc(np * k, sizeof *ch->plp_top_lps) : NULL;
            ok = ch->plp && (!k || (ch->plp_top_ids && ch->plp_top_lps));
            for (size_t j = 0; ok && j < np; j++)
                ch->plp[j] = (gw_tok_lp){.id = r->prompt_ids[j], .off = -1};
        }
    }
    req->gp = (pd_gw_gen_params){
        .request_id = req->id,
        .prompt_ids = r->prompt_ids,
        .n_prompt = r->n_prompt,
        .sampling = r->sampling,
        .max_tokens = r->max_tokens,
        .min_tokens = r->min_tokens,
        .ignore_eos = r->ignore_eos,
        .stop_token_ids = r->stop_token_ids,
        .n_stop_token_ids = r->n_stop_token_ids,
        .n = r->n,
        .logprobs = r->logprobs,
        .json_schema = r->json_schema,
        .prompt_logprobs = wants_prompt_logprobs(r),
        .prompt_top_logprobs = wants_prompt_logprobs(r) ? r->logprobs : 0,
    };
    if (!ok) {
        respond_error(req, 500, "out of memory", NULL, 0);
        req->st = NULL;
        req_free(req);
        return;
    }
    req->n_unfinished = req->n_engine_unfinished = r->n;

    req->submit_status = 0;
    int rc = req->srv->engine.submit(req->srv->engine_ctx, req, &req->gp);
    if (rc < 0) {
        int st = req->submit_status == 429 || req->submit_status == 400 ? req->submit_status : 503;
        const char *msg = req->submit_msg[0] ? req->submit_msg
                          : st == 429        ? "too many requests are queued; retry later"
                                             : "no replica is available to serve the request";
        PD_LOGW(GW_MOD, "%s: refused by the engine: %d %s", req->id, st, msg);
        respond_error(req, st, msg, NULL, req->retry_after);
        req->st = NULL;
        req_free(req);
        return;
    }
    req->submitted = true;
    PD_LOGD(GW_MOD, "%s: submitted, %d prompt tokens, max_tokens %d, n %d%s", req->id, r->n_prompt,
            r->max_tokens, r->n, r->stream ? ", stream" : "");
    if (r->stream)
        start_stream(req);
}

void gw_request_begin(gw_stream *st, gw_kind kind, const gw_route_check *refusal) {
    gw_server *s = st->conn->srv;
    pd_gw_request *req = calloc(1, sizeof *req);
    gw_job *job = calloc(1, sizeof *job);
    struct evbuffer *body = evbuffer_new();
    if (!req || !job || !body) {
        free(req);
        free(job);
        if (body)
            evbuffer_free(body);
        gw_stream_respond_error(st, 500, "out of memory", NULL, NULL, 0);
        return;
    }
    req->srv = s;
    s->n_requests++;
    req->next = s->reqs;
    if (s->reqs)
        s->reqs->prev = req;
    s->reqs = req;
    req->st = st;
    req->kind = kind;
    req->created = (int64_t)time(NULL);
    make_id(req);
    /* X-Request-Id: the client's (printable ASCII, < 136 bytes) or the id */
    const char *xrid = gw_stream_header(st, "X-Request-Id");
    bool sane = xrid && *xrid && strlen(xrid) < sizeof req->xrid;
    for (const char *p = xrid; sane && *p; p++)
        if (!isgraph((unsigned char)*p))
            sane = false;
    snprintf(req->xrid, sizeof req->xrid, "%s", sane ? xrid : req->id);
    PD_LOGD(GW_MOD, "%s: %s %s on conn %llu (%s)%s%s", req->id, st->method, st->path,
            (unsigned long long)st->conn->id, st->conn->proto->name, sane ? ", X-Request-Id " : "",
            sane ? req->xrid : "");

    if (refusal) {
        PD_LOGD(GW_MOD, "%s: refused: %d %s", req->id, refusal->status, refusal->message);
        respond_error(req, refusal->status, refusal->message, NULL, 0);
        req->st = NULL;
        evbuffer_free(body);
        gw_job_free(job);
        req_free(req);
        return;
    }

    evbuffer_add_buffer(body, st->body); /* moves the chunks, no copy */
    job->kind = kind;
    job->body = body;
    job->done = req_prepared;
    job->ud = req;
    req->job = job;
    gw_stream_set_close_cb(st, req_on_stream_close, req);
    gw_pool_submit(s->pool, job);
}
