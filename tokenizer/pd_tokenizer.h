/* tokenizer/ — byte-level BPE read from a Hugging Face tokenizer.json
 * (DeepSeek-V3's), the DeepSeek-V3 chat encoding, and an incremental
 * detokenizer for streaming.
 *
 * Read this header first. The reference for every id is Hugging Face
 * `tokenizers` (Tokenizer.from_file(path).encode(text,
 * add_special_tokens=False).ids); tests/reference/make_tok_fixtures.py makes
 * the golden fixture the tests compare against.
 *
 * The pipeline, as tokenizer.json describes it for DeepSeek-V3:
 *   1. added tokens (818: <｜begin▁of▁sentence｜>, <｜User｜>, ...) are cut out
 *      of the raw text first, leftmost-longest, in two passes as HF does:
 *      tokens with normalized=false, then (in what is left) normalized=true;
 *   2. the normalizer is an empty Sequence (identity);
 *   3. the pre-tokenizer is a Sequence of Split(Regex, Isolated) steps, each
 *      applied to every piece the previous step produced (matches and the
 *      gaps between them both become pieces), then ByteLevel with
 *      use_regex=false (only the GPT-2 byte -> unicode mapping);
 *   4. BPE over each piece (merge ranks from "merges", lowest rank first,
 *      leftmost first on ties), no byte fallback;
 *   5. decoding is ByteLevel (unicode -> bytes), then UTF-8 with invalid
 *      sequences replaced by U+FFFD.
 *
 * Unicode: the Split regexes run on PCRE2, but characters are classified
 * (\p{L}, \p{N}, \s, ...) by a Unicode 16.0 table, the version of the
 * Oniguruma inside HF tokenizers 0.23, not by the linked PCRE2's older
 * tables (tok_classmap.c explains how).
 *
 * Units: every length is in bytes; text is UTF-8. Token ids are int32_t.
 *
 * Threads: a loaded pd_tokenizer is immutable apart from an internal word
 * cache guarded by mutexes; every const function may be called from any
 * number of threads at once. A pd_detok belongs to one request (one thread
 * at a time).
 */
#ifndef PD_TOKENIZER_H
#define PD_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd_common.h"

/* DeepSeek-V3 special-token texts (tokenizer_config.json / added_tokens). */
#define PD_TOK_DSV3_BOS       "<｜begin▁of▁sentence｜>"
#define PD_TOK_DSV3_EOS       "<｜end▁of▁sentence｜>"
#define PD_TOK_DSV3_USER      "<｜User｜>"
#define PD_TOK_DSV3_ASSISTANT "<｜Assistant｜>"

/* ------------------------------------------------------------------ */
/* the tokenizer                                                       */
/* ------------------------------------------------------------------ */

typedef struct pd_tokenizer pd_tokenizer;

/** Loads a Hugging Face tokenizer.json whose model is byte-level BPE.
 * Supported shape (anything else is refused, never guessed): normalizer null
 * or an empty Sequence; pre_tokenizer a ByteLevel (use_regex=false) or a
 * Sequence of Split(Regex, behavior Isolated, invert false) steps followed by
 * that ByteLevel; model BPE without byte_fallback, dropout, or word
 * prefix/suffix, merges as "a b" strings or ["a","b"] pairs; decoder
 * ByteLevel; added_tokens without lstrip/rstrip/single_word.
 * On success *tok_p owns everything (free with pd_tok_free); on failure
 * *tok_p is untouched.
 * Errors (err names the file and the offending field): PD_ERR_INVALID (NULL
 * argument), PD_ERR_IO (cannot read), PD_ERR_FORMAT (bad JSON, missing or
 * ill-typed field, a merge naming an unknown token, a bad regex),
 * PD_ERR_UNSUPPORTED (a normalizer, pre-tokenizer, model or decoder of
 * another kind), PD_ERR_NOMEM. */
pd_status pd_tok_load(const char *tokenizer_json_path, pd_tokenizer **tok_p, pd_err *err);

/** Frees a tokenizer and sets *tok_p to NULL. NULL or *tok_p NULL is a no-op. */
void pd_tok_free(pd_tokenizer **tok_p);

/** Max id + 1 over the BPE vocab and the added tokens (128815 for
 * DeepSeek-V3; the embedding table is padded to 129280 by the model). Ids
 * below this with no token (gaps) are "unknown". */
int pd_tok_vocab_size(const pd_tokenizer *t);

/** The most bytes one token stands for (pd_tok_token_bytes), over every id:
 * 128 for DeepSeek-V3. Encoding covers every byte of the (UTF-8-repaired,
 * never shorter) text with tokens, so a text of len bytes encodes to at
 * least ceil(len / this) ids: a bound on the prompt length known before
 * encoding. 0 for NULL. */
size_t pd_tok_max_token_bytes(const pd_tokenizer *t);

/** Which added tokens pd_tok_encode_ex cuts out of the text. */
typedef enum {
    /** Every added token, special or not (HF's default). */
    PD_TOK_ADDED_ALL = 0,
    /** Only added tokens with special=false; the text of special ones
     * (<｜begin▁of▁sentence｜>, <｜end▁of▁sentence｜>, ...) is plain text.
     * This is HF's `tokenizer.encode_special_tokens = True`. Note that the
     * DeepSeek-V3 chat markers (<｜User｜>, <｜Assistant｜>, the tool-call
     * markers, FIM markers) are special=false and so still match. */
    PD_TOK_ADDED_NONSPECIAL,
    /** No added-token matching at all: everything is plain text. */
    PD_TOK_ADDED_NONE,
} pd_tok_added_mode;

/** Encodes len bytes of text (need not be NUL-terminated; may hold NULs).
 * parse_special=true is PD_TOK_ADDED_ALL (HF's default); false is
 * PD_TOK_ADDED_NONSPECIAL (special-token text becomes plain text, as HF with
 * encode_special_tokens=True). No BOS is added.
 * Invalid UTF-8 in text is not an error: each maximal ill-formed subsequence
 * (Unicode §3.9, "U+FFFD substitution of maximal subparts") is replaced by
 * U+FFFD before tokenizing, which is what Python's
 * bytes.decode("utf-8", errors="replace") gives when the request text is
 * built, so ids equal HF's on that replaced string.
 * On success *ids_p is a heap array of *n_p ids (non-NULL even when
 * *n_p == 0); the caller frees it with free().
 * Errors: PD_ERR_INVALID (t, ids_p or n_p NULL, or text NULL with len > 0),
 * PD_ERR_NOMEM, PD_ERR_LIMIT (the regex engine hit a resource limit). */
pd_status pd_tok_encode(const pd_tokenizer *t, const char *text, size_t len, bool parse_special,
                        int32_t **ids_p, size_t *n_p, pd_err *err);

/** pd_tok_encode with an explicit added-token mode (see pd_tok_added_mode).
 * Same ownership and errors; an out-of-range mode is PD_ERR_INVALID. */
pd_status pd_tok_encode_ex(const pd_tokenizer *t, const char *text, size_t len,
                           pd_tok_added_mode mode, int32_t **ids_p, size_t *n_p, pd_err *err);

/** The bytes one token stands for after ByteLevel decoding (for a vocab
 * entry "Ġthe": " the"; for an added token: its content). These may be a
 * fragment of a UTF-8 character. Borrowed from t (valid until pd_tok_free),
 * not NUL-terminated. Returns NULL and sets *len_p to 0 (if len_p is
 * non-NULL) for an id with no token. */
const char *pd_tok_token_bytes(const pd_tokenizer *t, int32_t id, size_t *len_p);

/** The token's text as tokenizer.json spells it (vocab key such as "Ġthe",
 * or an added token's content), NUL-terminated, borrowed from t; NULL for
 * an id with no token. This is HF's id_to_token. */
const char *pd_tok_token_text(const pd_tokenizer *t, int32_t id);

/** True when id is an added token marked special (skipped by decode with
 * skip_special). False for unknown ids. */
bool pd_tok_is_special(const pd_tokenizer *t, int32_t id);

/** True when id is an added token (tokenizer.json "added_tokens"), special
 * or not. False for unknown ids. */
bool pd_tok_is_added(const pd_tokenizer *t, int32_t id);

/** Id of the token spelled token_text (NUL-terminated) as tokenizer.json
 * does: an added token's content first, else a vocab key ("Ġthe", not
 * " the"). Returns -1 when there is none or an argument is NULL. */
int32_t pd_tok_find(const pd_tokenizer *t, const char *token_text);

/** Decodes n ids into text: token bytes concatenated (special tokens left
 * out when skip_special), then made valid UTF-8 by replacing each maximal
 * ill-formed subsequence with U+FFFD (as HF's String::from_utf8_lossy).
 * Ids with no token (negative, >= vocab_size, gaps; a model whose embedding
 * is padded past the vocab can sample those) are dropped, as HF does.
 * On success *text_p is a NUL-terminated heap string of *len_p bytes
 * (len_p may be NULL); the caller frees it with free().
 * Errors: PD_ERR_INVALID (NULL t or text_p, or ids NULL with n > 0),
 * PD_ERR_NOMEM. */
pd_status pd_tok_decode(const pd_tokenizer *t, const int32_t *ids, size_t n, bool skip_special,
                        char **text_p, size_t *len_p, pd_err *err);

/** Copies len bytes of s into a NUL-terminated heap string with every
 * maximal ill-formed UTF-8 subsequence replaced by U+FFFD (EF BF BD), the
 * same repair pd_tok_encode applies. *out_p is freed by the caller;
 * out_len_p may be NULL. Errors: PD_ERR_INVALID (NULL out_p, or s NULL with
 * len > 0), PD_ERR_NOMEM. */
pd_status pd_tok_utf8_repair(const char *s, size_t len, char **out_p, size_t *out_len_p,
                             pd_err *err);

/** True when the len bytes at s are well-formed UTF-8 (no surrogates, no
 * overlongs, nothing above U+10FFFF). */
bool pd_tok_utf8_valid(const char *s, size_t len);

/* ------------------------------------------------------------------ */
/* DeepSeek-V3 chat encoding                                           */
/* ------------------------------------------------------------------ */

/** One tool call of an assistant message (OpenAI: tool_calls[i].type,
 * .function.name, .function.arguments, arguments being a JSON text). */
typedef struct {
    const char *type; /* "function" */
    const char *name;
    const char *arguments;
} pd_tok_tool_call;

/** One chat message. role is "system", "user", "assistant" or "tool";
 * content is NULL only for an assistant message that carries tool calls
 * (the template renders tool_calls only when content is none). */
typedef struct {
    const char *role;
    const char *content;
    const pd_tok_tool_call *tool_calls;
    int n_tool_calls;
} pd_chat_message;

/** Renders messages with the DeepSeek-V3 chat template (the chat_template
 * of the published tokenizer_config.json), byte for byte as Jinja would:
 *   bos_token, then every system content joined with "\n\n";
 *   user:      "<｜User｜>" + content
 *   assistant: "<｜Assistant｜>" + content + "<｜end▁of▁sentence｜>", or right
 *              after tool output "<｜tool▁outputs▁end｜>" + content + eos;
 *              with content NULL, its tool calls (see chat.c for the exact
 *              strings, including the template's quirks);
 *   tool:      "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>" + content +
 *              "<｜tool▁output▁end｜>" for the first tool message of the
 *              conversation, "\n<｜tool▁output▁begin｜>" + ... after it;
 *   at the end "<｜tool▁outputs▁end｜>" if the last message was tool output,
 *   else "<｜Assistant｜>" when add_generation_prompt.
 * This template does not strip reasoning before "</think>" from assistant
 * content, so neither does this function. Messages of other roles are
 * ignored, as in the template. bos_token NULL renders as "" (the template's
 * undefined variable); pass PD_TOK_DSV3_BOS for the real one.
 * On success *text_p is a NUL-terminated heap string the caller frees.
 * Errors: PD_ERR_INVALID (NULL text_p, msgs NULL with n > 0, n < 0, a NULL
 * role, a NULL content where the template concatenates it (system, user,
 * tool), a tool call with a NULL field, or n_tool_calls > 0 with
 * tool_calls NULL; err names the message index), PD_ERR_NOMEM. */
pd_status pd_chat_render(const pd_chat_message *msgs, int n, bool add_generation_prompt,
                         const char *bos_token, char **text_p, pd_err *err);

/** Options of pd_chat_render_ex. system_suffix (NULL: none) is appended to
 * the joined system prompt, where DeepSeek-V3.1's template puts its tool
 * section (even with no system message). thinking: -1 renders the V3
 * template's generation prompt unchanged; 1 appends "<think>" to it and 0
 * "</think>", as DeepSeek-V3.1's template does for thinking on / off (no
 * generation prompt, no marker: after tool output, as in both templates). */
typedef struct {
    bool add_generation_prompt;
    const char *bos_token;
    const char *system_suffix;
    int thinking;
} pd_chat_render_opts;

/** pd_chat_render with options; pd_chat_render(m, n, gen, bos, …) is
 * pd_chat_render_ex with {gen, bos, NULL, -1}. Errors as pd_chat_render
 * (also PD_ERR_INVALID for o NULL). */
pd_status pd_chat_render_ex(const pd_chat_message *msgs, int n, const pd_chat_render_opts *o,
                            char **text_p, pd_err *err);

/* ------------------------------------------------------------------ */
/* incremental detokenizer                                             */
/* ------------------------------------------------------------------ */

typedef struct pd_detok pd_detok;

/** Starts an incremental detokenizer over t (borrowed: t must outlive it).
 * With skip_special, special tokens produce no text. Returns NULL only when
 * t is NULL or memory runs out. Free with pd_detok_free. */
pd_detok *pd_detok_new(const pd_tokenizer *t, bool skip_special);

/** Appends one token and returns in *out_p / *len_p the text that is now
 * complete: always valid UTF-8, never the first bytes of a character whose
 * remaining bytes may still come (those are held back, at most 3 bytes).
 * Bytes that can never become valid are emitted as U+FFFD, exactly as
 * pd_tok_decode would, so the concatenation of every push and the flush
 * equals pd_tok_decode of all the ids. An unknown id contributes nothing.
 * The output is borrowed from d until its next call; *len_p may be 0
 * (then *out_p points at an empty string). */
void pd_detok_push(pd_detok *d, int32_t id, const char **out_p, size_t *len_p);

/** Returns the held-back bytes, an incomplete character becoming U+FFFD, and
 * resets d for a new stream. Output borrowed as for pd_detok_push. */
void pd_detok_flush(pd_detok *d, const char **out_p, size_t *len_p);

/** Frees d and sets *d to NULL; NULL or *d NULL is a no-op. */
void pd_detok_free(pd_detok **d);

#endif
