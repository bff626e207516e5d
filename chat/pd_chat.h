/* pdserve chat output parsers: the model's generated text → reasoning,
 * content and tool calls, incrementally (feed text pieces as the
 * detokenizer produces them, get events), plus the tool section of the
 * prompt. Pure functions over text; no I/O, no globals; one parser per
 * choice, used by one thread at a time.
 *
 * Two stages, chained by pd_chat_parser:
 *
 *   text pieces ─▶ reasoning (<think> … </think>) ─▶ REASONING events
 *                                └─ the rest ─▶ tool calls ─▶ CONTENT / TOOL_CALL events
 *
 * Markers are matched on text, not on token ids: in the DeepSeek-V3
 * tokenizer "<think>" / "</think>" are ordinary text (several tokens) while
 * the tool-call markers are added tokens; in V3.1 both are added tokens.
 * Either way the detokenized text holds the marker, and a piece may end in
 * the middle of one (even in the middle of a UTF-8 sequence): the parser
 * holds back a suffix that may begin a marker until the next piece or the
 * end decides. So the concatenation of each kind of event does not depend
 * on where the text was split (tested for every split into 2 and 3 pieces).
 *
 * Formats (sources: vLLM deepseek_v3 / deepseek_v31 tool parsers and
 * deepseek_r1 reasoning parser; DeepSeek-V3.2 encoding_dsv32.py for DSML):
 *
 *   deepseek_v3 tool calls, V3 form (type and a fenced JSON block):
 *     <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>
 *     … more calls … <｜tool▁calls▁end｜>
 *   V3.1 form (no type, no fence): <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>
 *   deepseek_dsml (V3.2):
 *     <｜DSML｜function_calls>
 *     <｜DSML｜invoke name="NAME">
 *     <｜DSML｜parameter name="P" string="true">raw text</｜DSML｜parameter>
 *     <｜DSML｜parameter name="Q" string="false">JSON value</｜DSML｜parameter>
 *     </｜DSML｜invoke>
 *     </｜DSML｜function_calls>
 *
 * A call is held whole until its end marker and checked before it becomes
 * an event: ARGS must be a JSON object (DSML: every string="false" value
 * must be JSON), and NAME one of the request's tools when a list is given.
 * A call that fails a check, or is cut off by the end of the output, comes
 * out as CONTENT with its text as generated (markers included), never as a
 * half-made tool call.
 */
#ifndef PD_CHAT_H
#define PD_CHAT_H

#include <stdbool.h>
#include <stddef.h>

#include "pd_common.h"

/* ------------------------------------------------------------------ */
/* events                                                              */
/* ------------------------------------------------------------------ */

typedef enum {
    PD_CHAT_EV_CONTENT = 0, /* text of the answer: text/len */
    PD_CHAT_EV_REASONING,   /* text between <think> and </think>: text/len */
    PD_CHAT_EV_TOOL_CALL,   /* one whole, checked tool call: name, arguments */
} pd_chat_ev_kind;

/** One parser event. Every pointer is borrowed for the duration of the
 * callback only. text is not NUL-terminated (len bytes, len > 0); name and
 * arguments are NUL-terminated UTF-8; arguments is a JSON object text
 * (deepseek_v3: the model's own bytes, trimmed of surrounding whitespace;
 * DSML: built from the parameters, compact). tool_index counts the tool
 * calls of this parser from 0. */
typedef struct {
    pd_chat_ev_kind kind;
    const char *text;
    size_t len;
    const char *name;
    const char *arguments;
    int tool_index;
} pd_chat_event;

typedef void (*pd_chat_event_fn)(void *ud, const pd_chat_event *ev);

/* ------------------------------------------------------------------ */
/* configuration                                                       */
/* ------------------------------------------------------------------ */

typedef enum {
    PD_CHAT_REASONING_NONE = 0, /* --reasoning-parser none: all text is content */
    PD_CHAT_REASONING_DEEPSEEK_V3,
} pd_chat_reasoning_parser;

typedef enum {
    PD_CHAT_TOOLS_DEEPSEEK_V3 = 0, /* --tool-call-parser deepseek_v3 (V3 and V3.1 forms) */
    PD_CHAT_TOOLS_DEEPSEEK_DSML,   /* --tool-call-parser deepseek_dsml (V3.2) */
} pd_chat_tool_parser;

/** Where the output starts, as the prompt left it.
 *  AUTO:     the prompt did not open a think block; output that begins with
 *            "<think>" is reasoning up to "</think>", else it is all content
 *            (R1-style models that open the block themselves).
 *  THINKING: the prompt ended in "<think>" (thinking on): the output is
 *            reasoning up to "</think>" (a repeated leading "<think>" is
 *            dropped); without "</think>" all of it is reasoning, as in
 *            vLLM's deepseek_r1 parser.
 *  OFF:      thinking off or no reasoning parser: all content. */
typedef enum {
    PD_CHAT_THINK_AUTO = 0,
    PD_CHAT_THINK_ON,
    PD_CHAT_THINK_OFF,
} pd_chat_think_start;

/** A parser's settings. tool_names: the request's tools (borrowed; must
 * outlive the parser); n_tool_names 0 means any name is accepted.
 * parse_tools false (no tools, or tool_choice "none"): tool-call markers
 * are plain content. */
typedef struct {
    pd_chat_think_start think;
    bool parse_tools;
    pd_chat_tool_parser tool_parser;
    const char *const *tool_names;
    int n_tool_names;
} pd_chat_parser_opts;

/** Parses a parser name: "deepseek_v3" / "none" for reasoning,
 * "deepseek_v3" / "deepseek_dsml" for tool calls. Errors: PD_ERR_INVALID
 * (unknown name; err lists the accepted ones). */
pd_status pd_chat_reasoning_parser_from_str(const char *s, pd_chat_reasoning_parser *out_p,
                                            pd_err *err);
pd_status pd_chat_tool_parser_from_str(const char *s, pd_chat_tool_parser *out_p, pd_err *err);

/* ------------------------------------------------------------------ */
/* the parser                                                          */
/* ------------------------------------------------------------------ */

typedef struct pd_chat_parser pd_chat_parser;

/** A parser with opts (copied; tool_names borrowed) that reports events to
 * fn(ud, ev). Returns NULL only when memory is short. */
pd_chat_parser *pd_chat_parser_new(const pd_chat_parser_opts *opts, pd_chat_event_fn fn, void *ud);

/** Feeds len bytes of generated text (any split, even inside a marker or a
 * UTF-8 sequence). Events for what is decided come out of fn before it
 * returns; a suffix that may start a marker, and a tool call not yet ended,
 * are held. Errors: PD_ERR_NOMEM (the parser is then unusable: free it),
 * PD_ERR_INVALID (after pd_chat_parser_finish, or s NULL with len > 0). */
pd_status pd_chat_parser_feed(pd_chat_parser *p, const char *s, size_t len);

/** The output ended: everything held comes out (a cut-off tool call as
 * content, unterminated reasoning as reasoning). Feeding after this is an
 * error; calling it twice is a no-op. Errors: PD_ERR_NOMEM. */
pd_status pd_chat_parser_finish(pd_chat_parser *p);

/** Tool calls reported so far. */
int pd_chat_parser_n_tool_calls(const pd_chat_parser *p);

/** Frees *p and sets it to NULL; NULL and *p NULL are fine. */
void pd_chat_parser_free(pd_chat_parser **p);

/* ------------------------------------------------------------------ */
/* the tool section of the prompt                                      */
/* ------------------------------------------------------------------ */

/** One tool of the request (OpenAI tools[i].function): name, description
 * (NULL: none), parameters as a JSON text (NULL: "{}"). Borrowed. */
typedef struct {
    const char *name;
    const char *description;
    const char *parameters;
} pd_chat_tool;

/** The text appended to the system prompt for tools, in the format the
 * parser expects (deepseek_v3: DeepSeek-V3.1's tool section, calls in the
 * V3.1 form; deepseek_dsml: the same list with the DSML call format). The
 * exact strings are in tools.c and docs/api.md. It starts with "\n\n" (the
 * V3.1 template joins it to the system prompt so). On success *text_p is a
 * heap string the caller frees. Errors: PD_ERR_INVALID (NULL name, n < 0,
 * text_p NULL), PD_ERR_NOMEM. */
pd_status pd_chat_tools_prompt(const pd_chat_tool *tools, int n, pd_chat_tool_parser fmt,
                               char **text_p, pd_err *err);

#endif
