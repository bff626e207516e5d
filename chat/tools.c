/* The tool section of the prompt.
 *
 * deepseek_v3: the layout of DeepSeek-V3.1's model card ("ToolCall": a
 * "## Tools" section after the system prompt, one "### name" entry per tool
 * with its description and JSON-schema parameters) followed by the format
 * reminder of the V3.1 chat template as vLLM ships it
 * (examples/tool_chat_template_deepseekv31.jinja), joined to the system
 * prompt with "\n\n" as that template does. The calls it asks for are the
 * V3.1 form (NAME<｜tool▁sep｜>ARGS), which the deepseek_v3 parser reads
 * as well as the V3 form.
 *
 * deepseek_dsml: the same list, with the reminder written for the DSML
 * call format (our wording; DeepSeek-V3.2's own encoding_dsv32.py words
 * its tool prompt differently). The exact texts are in docs/api.md.
 */
#include <stdlib.h>
#include <string.h>

#include "chat_internal.h"

static const char V3_REMINDER[] =
    "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments"
    "<｜tool▁call▁end｜>{{additional_tool_calls}}<｜tool▁calls▁end｜>\n\n"
    "Where:\n\n"
    "- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters "
    "Schema\n"
    "- For multiple tool calls, chain them directly without separators or spaces\n";

static const char DSML_REMINDER[] =
    "IMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    "<｜DSML｜function_calls>\n"
    "<｜DSML｜invoke name=\"tool_call_name\">\n"
    "<｜DSML｜parameter name=\"parameter_name\" string=\"true\">parameter_value"
    "</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜function_calls>\n\n"
    "Where:\n\n"
    "- `tool_call_name` must be an exact match to one of the available tools\n"
    "- string=\"true\" when the value is a string written as raw text; string=\"false\" when "
    "it is a number, boolean, null, array or object written as JSON\n"
    "- For multiple tool calls, write one invoke element per call inside the same "
    "function_calls element\n";

pd_status pd_chat_tools_prompt(const pd_chat_tool *tools, int n, pd_chat_tool_parser fmt,
                               char **text_p, pd_err *err) {
    if (!text_p || n < 0 || (n > 0 && !tools))
        return pd_err_set(err, PD_ERR_INVALID, "pd_chat_tools_prompt: bad argument");
    chat_buf b = {0};
    pd_status st = chat_buf_add(&b, "", 0);
#define ADD(s)                                                                                     \
    do {                                                                                           \
        if (st == PD_OK)                                                                           \
            st = chat_buf_add(&b, (s), strlen(s));                                                 \
    } while (0)
    ADD("\n\n## Tools\nYou have access to the following tools:\n");
    for (int i = 0; i < n; i++) {
        if (!tools[i].name) {
            chat_buf_free(&b);
            return pd_err_set(err, PD_ERR_INVALID, "pd_chat_tools_prompt: tool %d has no name", i);
        }
        ADD("\n### ");
        ADD(tools[i].name);
        ADD("\nDescription: ");
        ADD(tools[i].description ? tools[i].description : "");
        ADD("\n\nParameters: ");
        ADD(tools[i].parameters ? tools[i].parameters : "{}");
        ADD("\n");
    }
    ADD("\n");
    ADD(fmt == PD_CHAT_TOOLS_DEEPSEEK_DSML ? DSML_REMINDER : V3_REMINDER);
#undef ADD
    if (st != PD_OK) {
        chat_buf_free(&b);
        return pd_err_set(err, PD_ERR_NOMEM, "pd_chat_tools_prompt: out of memory");
    }
    *text_p = b.p;
    return PD_OK;
}
