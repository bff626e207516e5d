// Tool calls and reasoning through the official `openai` npm client:
// argv[2] = JSON {tools_body, reasoning_body}, argv[3] = base URL. Prints one
// JSON line: the non-streamed tool_calls and finish_reason, the streamed
// tool_calls assembled per index as clients do (id/type/name from the
// first delta, arguments concatenated), and reasoning_content / content,
// non-streamed and streamed.
import OpenAI from "openai";

const req = JSON.parse(process.argv[2]);
const client = new OpenAI({ baseURL: process.argv[3], apiKey: "none", maxRetries: 0, timeout: 60000 });
const out = {};

const r = await client.chat.completions.create({ ...req.tools_body, stream: false });
out.calls = r.choices[0].message.tool_calls;
out.finish = r.choices[0].finish_reason;
const s = await client.chat.completions.create({ ...req.tools_body, stream: true });
const acc = [];
for await (const ev of s) {
  for (const ch of ev.choices) {
    for (const tc of ch.delta?.tool_calls ?? []) {
      acc[tc.index] ??= { id: tc.id, type: tc.type, function: { name: "", arguments: "" } };
      acc[tc.index].function.name += tc.function?.name ?? "";
      acc[tc.index].function.arguments += tc.function?.arguments ?? "";
    }
    if (ch.finish_reason) out.stream_finish = ch.finish_reason;
  }
}
out.stream_calls = acc;

const q = await client.chat.completions.create({ ...req.reasoning_body, stream: false });
out.reasoning = q.choices[0].message.reasoning_content;
out.content = q.choices[0].message.content;
const t = await client.chat.completions.create({ ...req.reasoning_body, stream: true });
out.stream_reasoning = "";
out.stream_content = "";
for await (const ev of t)
  for (const ch of ev.choices) {
    out.stream_reasoning += ch.delta?.reasoning_content ?? "";
    out.stream_content += ch.delta?.content ?? "";
  }
console.log(JSON.stringify(out));
