// Runs the requests given as JSON on argv[2] through the official `openai`
// npm client against base URL argv[3], streaming and not, and prints one
// JSON line per request: {text, stream_text, usage, stream_usage, finish}.
import OpenAI from "openai";

const cases = JSON.parse(process.argv[2]);
const client = new OpenAI({ baseURL: process.argv[3], apiKey: "none", maxRetries: 0, timeout: 60000 });

for (const c of cases) {
  const out = {};
  if (c.kind === "chat") {
    const r = await client.chat.completions.create({ ...c.body, stream: false });
    out.text = r.choices[0].message.content;
    out.usage = r.usage;
    out.finish = r.choices[0].finish_reason;
    const s = await client.chat.completions.create({ ...c.body, stream: true, stream_options: { include_usage: true } });
    let t = "";
    for await (const ev of s) {
      for (const ch of ev.choices) t += ch.delta?.content ?? "";
      if (ev.usage) out.stream_usage = ev.usage;
    }
    out.stream_text = t;
  } else {
    const r = await client.completions.create({ ...c.body, stream: false });
    out.text = r.choices[0].text;
    out.usage = r.usage;
    out.finish = r.choices[0].finish_reason;
    const s = await client.completions.create({ ...c.body, stream: true, stream_options: { include_usage: true } });
    let t = "";
    for await (const ev of s) {
      for (const ch of ev.choices) t += ch.text ?? "";
      if (ev.usage) out.stream_usage = ev.usage;
    }
    out.stream_text = t;
  }
  console.log(JSON.stringify(out));
}
