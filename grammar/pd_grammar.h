/* grammar/ — constrained decoding for OpenAI response_format: a JSON Schema
 * subset compiled into a byte-level pushdown automaton, and per decoding
 * step the set of vocabulary tokens whose bytes the automaton accepts (a
 * mask on the logits), so that the generated text always parses as JSON
 * and validates against the schema.
 *
 * Read this header first. Three objects:
 *   - pd_grammar: a compiled schema (immutable; any number of threads and
 *     requests may share it);
 *   - pd_grammar_vocab: the vocabulary as a byte trie built from the
 *     tokenizer (immutable, shared by every request of a replica);
 *   - pd_grammar_state: one request's position in the automaton, plus the
 *     scratch its mask needs (one thread at a time).
 *
 * The automaton is deterministic: a stack of frames (root, object, array,
 * string, number, literal), each byte either moves it or is refused. It
 * emits a canonical subset of the JSON the schema allows: no whitespace
 * except at most one space after ':' and after ',' (so a model cannot loop
 * on whitespace), object properties in the schema's order (optional ones
 * may be left out, no property the schema does not list), strings as valid
 * UTF-8 without control characters (\uXXXX escapes, but not of surrogates),
 * numbers of at most PD_GRAMMAR_MAX_NUMBER_LEN characters (and of the
 * sizes an int64 or a double holds, RFC 8259 §6), output values
 * nested at most PD_GRAMMAR_MAX_DEPTH deep. Every text it accepts as
 * complete is one JSON value that validates against the schema (the
 * property grammar/tests/test_grammar.c checks on random walks).
 *
 * Supported schema subset (anything else is refused with PD_ERR_UNSUPPORTED
 * naming the keyword and where it is, never ignored):
 *   type (a name or an array of names: object, array, string, number,
 *   integer, boolean, null), properties, required, additionalProperties
 *   (false, true or a schema; only for objects without properties: with
 *   properties, only those are generated, which validates either way),
 *   items, minItems, maxItems, minLength, maxLength (in code points),
 *   minimum, maximum, exclusiveMinimum, exclusiveMaximum (on integers:
 *   each digit must keep a value in range within reach), enum,
 *   const, anyOf and oneOf (alternatives must start with different bytes,
 *   i.e. be of different JSON types, so that the automaton stays
 *   deterministic; then oneOf == anyOf), boolean schemas (true = any
 *   value), $ref into the same schema ("#/$defs/Name", any "#/..." JSON
 *   pointer; not recursive; each target compiled once and shared).
 *   Annotations are ignored: title, description, $schema, $id, $comment,
 *   default, examples, deprecated, readOnly, writeOnly, and the $defs /
 *   definitions containers.
 *   With no type, the keywords imply one (properties -> object, items ->
 *   array, minLength -> string), else any JSON value.
 *
 * Sources: the JSON grammar of RFC 8259; JSON Schema 2020-12 validation
 * vocabulary for the keywords' meaning; the approach (token trie walked
 * through a pushdown automaton, EOS only when complete) as in llama.cpp's
 * grammar sampler and xgrammar (arXiv 2411.15100), reimplemented here.
 */
#ifndef PD_GRAMMAR_H
#define PD_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd_common.h"
#include "pd_tokenizer.h"

/* Limits (a schema past one is refused with PD_ERR_LIMIT). */
#define PD_GRAMMAR_MAX_SCHEMA_BYTES (64 * 1024) /* schema JSON text */
#define PD_GRAMMAR_MAX_SCHEMA_DEPTH 16          /* nested subschemas */
#define PD_GRAMMAR_MAX_NODES        1024        /* compiled subschemas */
#define PD_GRAMMAR_MAX_PROPERTIES   256         /* per object */
#define PD_GRAMMAR_MAX_ENUM         256         /* values per enum */
#define PD_GRAMMAR_MAX_LITERAL      4096        /* bytes of one enum/const value as JSON */
/* Limits on the generated text (bytes past them are refused). */
#define PD_GRAMMAR_MAX_DEPTH      32 /* nesting of arrays/objects in the output */
#define PD_GRAMMAR_MAX_NUMBER_LEN 32 /* characters of one number */
#define PD_GRAMMAR_MAX_INT_DIGITS 18 /* digits before the point: fits an int64 */
#define PD_GRAMMAR_MAX_EXP_DIGITS 2  /* exponent digits: |e| <= 99, fits a double */

/* ------------------------------------------------------------------ */
/* compiled schemas                                                    */
/* ------------------------------------------------------------------ */

typedef struct pd_grammar pd_grammar;

/** Compiles len bytes of JSON Schema text (the subset above). On success
 * *g_p owns everything (free with pd_grammar_free).
 * Errors (err->msg names the problem and where, as a path such as
 * "properties.name.items"): PD_ERR_INVALID (NULL argument, not JSON, a
 * keyword of the wrong type or out of range, an unsatisfiable schema such
 * as false or an empty enum), PD_ERR_UNSUPPORTED ("unsupported schema
 * keyword: pattern at properties.name", anyOf alternatives of one type),
 * PD_ERR_LIMIT (a PD_GRAMMAR_MAX_* limit of the schema). */
pd_status pd_grammar_compile(const char *schema, size_t len, pd_grammar **g_p, pd_err *err);

/** The schema of OpenAI's {"type": "json_object"}: any JSON object. */
#define PD_GRAMMAR_JSON_OBJECT "{\"type\":\"object\"}"

/** The schema as compact JSON (key order kept), NUL-terminated, borrowed
 * from g: what the gateway sends to replicas, which compile it again. */
const char *pd_grammar_canonical(const pd_grammar *g);

/** Frees g and sets *g_p to NULL; NULL or *g_p NULL is a no-op. */
void pd_grammar_free(pd_grammar **g_p);

/* ------------------------------------------------------------------ */
/* the vocabulary                                                      */
/* ------------------------------------------------------------------ */

typedef struct pd_grammar_vocab pd_grammar_vocab;

/** Builds the byte trie of tok's vocabulary for logits of vocab_size
 * entries (the model's, >= the tokenizer's; ids past the tokenizer's never
 * pass a mask). Added tokens (special or not) and empty tokens never pass
 * either, except eos_id, which passes exactly when the value is complete.
 * Copies what it needs: tok may be freed afterwards. Cost: about a second
 * and ~30 MB for DeepSeek-V3's 128815 tokens (see docs/benchmarks.md).
 * Errors: PD_ERR_INVALID (NULL argument, vocab_size smaller than the
 * tokenizer's, eos_id outside [0, vocab_size)), PD_ERR_NOMEM. */
pd_status pd_grammar_vocab_init(const pd_tokenizer *tok, int vocab_size, int32_t eos_id,
                                pd_grammar_vocab **v_p, pd_err *err);

/** pd_grammar_vocab_init from a tokenizer.json file (loaded and freed
 * here): what replicas call, lazily, on their first constrained request.
 * Errors: those of pd_tok_load (err names the path) and of
 * pd_grammar_vocab_init. */
pd_status pd_grammar_vocab_load(const char *tokenizer_json, int vocab_size, int32_t eos_id,
                                pd_grammar_vocab **v_p, pd_err *err);

/** Frees v and sets *v_p to NULL; NULL or *v_p NULL is a no-op. */
void pd_grammar_vocab_free(pd_grammar_vocab **v_p);

/* ------------------------------------------------------------------ */
/* one request's state                                                 */
/* ------------------------------------------------------------------ */

typedef struct pd_grammar_state pd_grammar_state;

/** A state at the start of g's value. g and v are borrowed and must
 * outlive the state; v may be NULL for byte-level use only (the token and
 * mask functions then refuse everything). Memory is fixed at init (the
 * frame stacks, the mask bitmap): no step allocates.
 * Errors: PD_ERR_INVALID (g NULL), PD_ERR_NOMEM. */
pd_status pd_grammar_state_init(const pd_grammar *g, const pd_grammar_vocab *v,
                                pd_grammar_state **s_p, pd_err *err);

/** Frees s and sets *s_p to NULL; NULL or *s_p NULL is a no-op. */
void pd_grammar_state_free(pd_grammar_state **s_p);

/** Feeds n bytes; all or nothing: returns false (state unchanged) when
 * the automaton refuses one of them. */
bool pd_grammar_state_accept_bytes(pd_grammar_state *s, const uint8_t *bytes, size_t n);

/** Feeds one token's bytes (the EOS id: ends the value, allowed only when
 * complete). Returns false, state unchanged, for a token the mask would
 * not allow. */
bool pd_grammar_state_accept_token(pd_grammar_state *s, int32_t token);

/** True when the bytes so far are one complete value (EOS may follow). */
bool pd_grammar_state_is_complete(const pd_grammar_state *s);

/** True when the value is complete and no byte can extend it: only EOS is
 * allowed (a number at the top level can always grow up to its limit, so
 * it is complete long before it is terminal). */
bool pd_grammar_state_is_terminal(const pd_grammar_state *s);

/** Sets logits[i] = -inf for every token the automaton refuses now
 * (logits has the vocab's vocab_size entries). Returns how many tokens are
 * allowed (0 only if v is NULL or after EOS).
 * tokens_left (< 0: no limit) is how many tokens may still be generated,
 * this one included (max_tokens minus those generated): then a token is
 * allowed only if the shortest completion after it (counted in bytes, each
 * of which a single-byte token can spell) fits in the tokens left after
 * it, so that the value is complete when max_tokens is reached. When that
 * leaves nothing (tokens_left was too small from the start), the limit is
 * dropped and the text may end incomplete (finish_reason "length").
 * Cost: one walk of the trie pruned by the automaton; inside a string the
 * tokens that are plain string content come from a precomputed list
 * (docs/benchmarks.md); at most two walks. */
int pd_grammar_state_mask_logits(pd_grammar_state *s, float *logits, int64_t tokens_left);

/** The allowed set as a bitmap: bit i of words[i / 32] for token i; words
 * has room for (vocab_size + 31) / 32 entries. tokens_left as for
 * pd_grammar_state_mask_logits. Returns the count allowed. */
int pd_grammar_state_fill_mask(pd_grammar_state *s, uint32_t *words, int64_t tokens_left);

#endif
