/* Prompts of an exact token length, built with the model's own tokenizer,
 * and the long-context retrieval task.
 *
 * Text prompts are random sentences over a fixed English word list. The
 * text is encoded, cut to n ids, decoded and encoded again; when a cut in
 * the middle of a merge makes the second encoding longer or shorter, the
 * cut moves by the difference and the round trip is tried again. The
 * result is a string the server's tokenizer (the same tokenizer.json) turns
 * into exactly n tokens. Servers prepend BOS to a /v1/completions text
 * prompt when tokenizer_config.json says add_bos_token (vLLM, SGLang and
 * pdserve all do for DeepSeek), so callers ask for n - 1 there.
 */
#include <string.h>

#include "pd_bench.h"

static const char *const words[] = {
    "the",     "of",       "and",         "to",        "in",       "is",       "that",
    "for",     "it",       "as",          "was",       "with",     "be",       "by",
    "on",      "not",      "he",          "this",      "are",      "or",       "his",
    "from",    "at",       "which",       "but",       "have",     "an",       "had",
    "they",    "you",      "were",        "their",     "one",      "all",      "we",
    "can",     "her",      "has",         "there",     "been",     "if",       "more",
    "when",    "will",     "would",       "who",       "so",       "no",       "time",
    "people",  "year",     "way",         "day",       "man",      "thing",    "woman",
    "life",    "child",    "world",       "school",    "state",    "family",   "student",
    "group",   "country",  "problem",     "hand",      "part",     "place",    "case",
    "week",    "company",  "system",      "program",   "question", "work",     "government",
    "number",  "night",    "point",       "home",      "water",    "room",     "mother",
    "area",    "money",    "story",       "fact",      "month",    "lot",      "right",
    "study",   "book",     "eye",         "job",       "word",     "business", "issue",
    "side",    "kind",     "head",        "house",     "service",  "friend",   "father",
    "power",   "hour",     "game",        "line",      "end",      "member",   "law",
    "car",     "city",     "name",        "president", "team",     "minute",   "idea",
    "kid",     "body",     "information", "back",      "parent",   "face",     "others",
    "level",   "office",   "door",        "health",    "person",   "art",      "war",
    "history", "party",    "result",      "change",    "morning",  "reason",   "research",
    "girl",    "guy",      "moment",      "air",       "teacher",  "force",    "education",
    "river",   "mountain", "garden",      "market",    "letter",   "music",    "window",
    "street",  "summer",   "winter",      "village",   "bridge",   "island",   "small",
    "large",   "early",    "young",       "important", "few",      "public",   "bad",
    "same",    "able",     "quiet",       "bright",    "green",    "old",      "new",
    "long",    "makes",    "takes",       "finds",     "gives",    "tells",    "builds",
    "carries", "follows",  "opens",       "writes",    "reads",    "watches",  "remembers",
    "brings",  "keeps",    "holds",
};
#define N_WORDS ((int)(sizeof words / sizeof words[0]))

/* Appends about n_words words of random sentences (6..15 words each). */
static int gen_words(pd_bench_buf *b, pd_rng *rng, int n_words) {
    int left_in_sentence = 0;
    for (int i = 0; i < n_words; i++) {
        const char *w = words[pd_rng_next(rng) % N_WORDS];
        char tmp[32];
        snprintf(tmp, sizeof tmp, "%s", w);
        if (left_in_sentence == 0) {
            tmp[0] = (char)(tmp[0] - 'a' + 'A');
            left_in_sentence = 6 + (int)(pd_rng_next(rng) % 10);
        }
        if ((b->len && pd_bench_buf_append(b, " ", 1)) || pd_bench_buf_append(b, tmp, strlen(tmp)))
            return -1;
        if (--left_in_sentence == 0 && pd_bench_buf_append(b, ".", 1))
            return -1;
        else if (left_in_sentence > 2 && pd_rng_next(rng) % 12 == 0 &&
                 pd_bench_buf_append(b, ",", 1))
            return -1;
    }
    return 0;
}

/* Random text of at least n + 1 tokens; its ids in *ids_p / *m_p. */
static pd_status long_enough(const pd_tokenizer *t, pd_rng *rng, int n, pd_bench_buf *b,
                             int32_t **ids_p, size_t *m_p, pd_err *err) {
    int more = n + 8;
    for (;;) {
        if (gen_words(b, rng, more))
            return pd_err_set(err, PD_ERR_NOMEM, "bench: out of memory building a prompt");
        int32_t *ids = NULL;
        size_t m = 0;
        pd_status st = pd_tok_encode(t, b->data, b->len, false, &ids, &m, err);
        if (st != PD_OK)
            return st;
        if (m > (size_t)n) {
            *ids_p = ids;
            *m_p = m;
            return PD_OK;
        }
        free(ids);
        more = (int)((size_t)n - m) + 16;
    }
}

pd_status pd_bench_prompt_text(const pd_tokenizer *t, pd_rng *rng, int n, char **text_p,
                               pd_err *err) {
    if (!t || !rng || !text_p || n < 1)
        return pd_err_set(err, PD_ERR_INVALID, "bench: a prompt needs at least 1 token, got %d", n);
    pd_bench_buf b = {0};
    int32_t *ids = NULL;
    size_t m = 0;
    pd_status st = long_enough(t, rng, n, &b, &ids, &m, err);
    pd_bench_buf_free(&b);
    if (st != PD_OK)
        return st;
    int k = n;
    st = pd_err_set(err, PD_ERR_NOTFOUND, "bench: no text of exactly %d tokens found", n);
    for (int attempt = 0; attempt < 8 && k >= 1 && (size_t)k <= m; attempt++) {
        char *text = NULL;
        size_t tl = 0;
        int32_t *again = NULL;
        size_t m2 = 0;
        pd_status s2 = pd_tok_decode(t, ids, (size_t)k, false, &text, &tl, err);
        if (s2 == PD_OK)
            s2 = pd_tok_encode(t, text, tl, false, &again, &m2, err);
        free(again);
        if (s2 != PD_OK) {
            free(text);
            st = s2;
            break;
        }
        if (m2 == (size_t)n) {
            *text_p = text;
            st = PD_OK;
            break;
        }
        free(text);
        k += n - (int)m2;
    }
    free(ids);
    return st;
}

pd_status pd_bench_prompt_ids(const pd_tokenizer *t, pd_rng *rng, int n, int32_t **ids_p,
                              pd_err *err) {
    if (!t || !rng || !ids_p || n < 1)
        return pd_err_set(err, PD_ERR_INVALID, "bench: a prompt needs at least 1 token, got %d", n);
    pd_bench_buf b = {0};
    int32_t *ids = NULL;
    size_t m = 0;
    pd_status st = long_enough(t, rng, n, &b, &ids, &m, err);
    pd_bench_buf_free(&b);
    if (st == PD_OK)
        *ids_p = ids; /* the first n of m > n ids */
    return st;
}

/* ---- tokenizer + config ----------------------------------------------------- */

int pd_bench_chat_tokens(const pd_bench_tok *bt, const char *content) {
    pd_chat_message msg = {.role = "user", .content = content};
    char *text = NULL;
    pd_err err;
    if (pd_chat_render(&msg, 1, true, PD_TOK_DSV3_BOS, &text, &err) != PD_OK)
        return -1;
    int32_t *ids = NULL;
    size_t n = 0;
    pd_status st = pd_tok_encode(bt->tok, text, strlen(text), true, &ids, &n, &err);
    free(text);
    free(ids);
    return st == PD_OK ? (int)n : -1;
}

pd_status pd_bench_tok_load(const char *tokenizer_json, pd_bench_tok *bt, pd_err *err) {
    memset(bt, 0, sizeof *bt);
    bt->bos_id = -1;
    pd_status st = pd_tok_load(tokenizer_json, &bt->tok, err);
    if (st != PD_OK)
        return st;
    /* tokenizer_config.json next to tokenizer.json: add_bos_token, bos_token */
    char cfg[4096];
    const char *slash = strrchr(tokenizer_json, '/');
    int dl = slash ? (int)(slash - tokenizer_json) + 1 : 0;
    snprintf(cfg, sizeof cfg, "%.*stokenizer_config.json", dl, tokenizer_json);
    json_error_t je;
    json_t *c = json_load_file(cfg, 0, &je);
    const char *bos = PD_TOK_DSV3_BOS;
    if (c) {
        bt->add_bos = json_is_true(json_object_get(c, "add_bos_token"));
        json_t *b = json_object_get(c, "bos_token");
        if (json_is_object(b))
            b = json_object_get(b, "content");
        if (json_is_string(b))
            bos = json_string_value(b);
        bt->bos_id = pd_tok_find(bt->tok, bos);
        json_decref(c);
    } else
        bt->bos_id = pd_tok_find(bt->tok, bos);
    if (bt->bos_id < 0)
        bt->add_bos = false;
    bt->chat_overhead = pd_bench_chat_tokens(bt, "");
    if (bt->chat_overhead < 0) {
        pd_tok_free(&bt->tok);
        return pd_err_set(err, PD_ERR_FORMAT, "bench: cannot render a chat with %s",
                          tokenizer_json);
    }
    return PD_OK;
}

void pd_bench_tok_free(pd_bench_tok *bt) {
    if (bt)
        pd_tok_free(&bt->tok);
}

/* ---- retrieval --------------------------------------------------------------- */

static const char *const projects[] = {
    "Falcon", "Juniper", "Cobalt", "Meridian", "Aurora",  "Sequoia", "Tundra", "Obsidian",
    "Zephyr", "Halcyon", "Quartz", "Nimbus",   "Saffron", "Vortex",  "Lumen",  "Pinnacle",
};
#define N_PROJECTS ((int)(sizeof projects / sizeof projects[0]))

static const char intro[] = "Read the following document carefully.\n\n";
static const char question[] =
    "\n\nThe document above hides the access codes of three projects. Reply with only a JSON "
    "object that maps each project name to its access code, for example {\"Name\": "
    "\"ABCD-1234\"}, and nothing else.";

/* intro, filler 0, code 0, filler 1, code 1, filler 2, code 2, filler 3, question */
static pd_status assemble(char *const pieces[4], const pd_bench_retrieval *rt, pd_bench_buf *out,
                          pd_err *err) {
    out->len = 0;
    if (pd_bench_buf_append(out, intro, sizeof intro - 1))
        goto nomem;
    for (int i = 0; i < 4; i++) {
        if (pd_bench_buf_append(out, pieces[i], strlen(pieces[i])))
            goto nomem;
        if (i < 3 && pd_bench_buf_printf(out, "\n\nThe access code for project %s is %s.\n\n",
                                         rt->names[i], rt->codes[i]))
            goto nomem;
    }
    if (pd_bench_buf_append(out, question, sizeof question - 1))
        goto nomem;
    return PD_OK;
nomem:
    return pd_err_set(err, PD_ERR_NOMEM, "bench: out of memory building a retrieval document");
}

pd_status pd_bench_retrieval_build(const pd_bench_tok *bt, pd_rng *rng, int n_tokens,
                                   pd_bench_retrieval *rt, pd_err *err) {
    memset(rt, 0, sizeof *rt);
    if (n_tokens < 200)
        return pd_err_set(err, PD_ERR_INVALID, "bench: a retrieval document needs >= 200 tokens");
    /* three distinct projects and their codes */
    int pick[3];
    for (int i = 0; i < 3; i++) {
        int again;
        do {
            pick[i] = (int)(pd_rng_next(rng) % N_PROJECTS);
            again = 0;
            for (int j = 0; j < i; j++)
                again |= pick[j] == pick[i];
        } while (again);
        snprintf(rt->names[i], sizeof rt->names[i], "%s", projects[pick[i]]);
        static const char alnum[] = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789";
        for (int k = 0; k < 9; k++)
            rt->codes[i][k] = k == 4 ? '-' : alnum[pd_rng_next(rng) % (sizeof alnum - 1)];
        rt->codes[i][9] = 0;
    }
    /* tokens around the filler: measure the document with one-token fillers */
    char *pieces[4] = {0};
    int fill[4];
    pd_bench_buf doc = {0};
    pd_status st = PD_OK;
    for (int i = 0; i < 4 && st == PD_OK; i++)
        if (!(pieces[i] = strdup("the")))
            st = pd_err_set(err, PD_ERR_NOMEM, "bench: out of memory");
    if (st == PD_OK)
        st = assemble(pieces, rt, &doc, err);
    int fixed = st == PD_OK ? pd_bench_chat_tokens(bt, doc.data) - 4 : -1;
    if (st == PD_OK && fixed < 0)
        st = pd_err_set(err, PD_ERR_FORMAT, "bench: cannot count the retrieval prompt");
    int F = n_tokens - fixed;
    if (st == PD_OK && F < 8)
        st = pd_err_set(err, PD_ERR_INVALID, "bench: %d tokens leave no room for the document",
                        n_tokens);
    if (st == PD_OK) {
        /* codes at 10%, 50%, 90% of the filler */
        fill[0] = F / 10, fill[1] = F * 4 / 10, fill[2] = F * 4 / 10;
        fill[3] = F - fill[0] - fill[1] - fill[2];
        for (int i = 0; i < 4 && st == PD_OK; i++) {
            free(pieces[i]);
            pieces[i] = NULL;
            st = pd_bench_prompt_text(bt->tok, rng, fill[i] < 1 ? 1 : fill[i], &pieces[i], err);
        }
    }
    /* merges across the joins may shift the count: correct the last filler */
    for (int attempt = 0; st == PD_OK && attempt < 4; attempt++) {
        st = assemble(pieces, rt, &doc, err);
        if (st != PD_OK)
            break;
        rt->tokens = pd_bench_chat_tokens(bt, doc.data);
        int delta = n_tokens - rt->tokens;
        if (delta == 0 || fill[3] + delta < 1)
            break;
        fill[3] += delta;
        free(pieces[3]);
        pieces[3] = NULL;
        st = pd_bench_prompt_text(bt->tok, rng, fill[3], &pieces[3], err);
    }
    for (int i = 0; i < 4; i++)
        free(pieces[i]);
    if (st != PD_OK) {
        pd_bench_buf_free(&doc);
        return st;
    }
    rt->content = doc.data; /* the buffer's string is ours now */
    return PD_OK;
}

void pd_bench_retrieval_free(pd_bench_retrieval *rt) {
    if (rt) {
        free(rt->content);
        memset(rt, 0, sizeof *rt);
    }
}

int pd_bench_retrieval_score(const pd_bench_retrieval *rt, const char *answer) {
    if (!answer)
        return 0;
    const char *brace = strchr(answer, '{');
    if (!brace)
        return 0;
    json_error_t je;
    json_t *o = json_loads(brace, JSON_DISABLE_EOF_CHECK, &je);
    if (!json_is_object(o)) {
        json_decref(o);
        return 0;
    }
    int score = 0;
    for (int i = 0; i < 3; i++) {
        json_t *v = json_object_get(o, rt->names[i]);
        if (json_is_string(v) && !strcmp(json_string_value(v), rt->codes[i]))
            score++;
    }
    json_decref(o);
    return score;
}
