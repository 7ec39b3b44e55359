"""The playground at ``/``: a prompt box and sampling controls; the completion streams in from
``/v1/completions`` (server-sent events read from fetch's body), with the token count and tokens/s.
One self-contained page: no scripts or styles from elsewhere."""

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>gptrain playground</title>
<style>
 body { font-family: system-ui, sans-serif; max-width: 52rem; margin: 2rem auto; padding: 0 1rem; }
 textarea { width: 100%; height: 8rem; font: 1rem monospace; }
 #output { white-space: pre-wrap; font: 1rem monospace; border: 1px solid #ccc; padding: .75rem; min-height: 6rem; }
 #output .completion { background: #e8f0fe; }
 fieldset { display: flex; gap: 1rem; flex-wrap: wrap; border: 0; padding: .5rem 0; }
 label { display: flex; flex-direction: column; font-size: .85rem; }
 input[type=number] { width: 6rem; }
 #stats { color: #555; font-size: .9rem; margin: .5rem 0; }
 #error { color: #b00020; }
</style>
</head>
<body>
<h1>gptrain playground <small>({{MODEL}})</small></h1>
<textarea id="prompt" placeholder="Type a prompt">The meaning of life is</textarea>
<fieldset>
 <label>max tokens <input id="max_tokens" type="number" min="1" value="64"></label>
 <label>temperature <input id="temperature" type="number" min="0" max="100" step="0.05" value="0.8"></label>
 <label>top-k <input id="top_k" type="number" min="0" max="1000" value="0"></label>
 <label>top-p <input id="top_p" type="number" min="0.01" max="1" step="0.01" value="0.95"></label>
 <label>seed (blank: random) <input id="seed" type="number" min="0"></label>
 <label>stop <input id="stop" type="text" placeholder="e.g. \\n\\n"></label>
</fieldset>
<button id="generate">Generate</button> <button id="stopbtn" disabled>Stop</button>
<div id="stats"><span id="count">0</span> tokens, <span id="rate">0.0</span> tokens/s <span id="state"></span></div>
<div id="error"></div>
<div id="output"><span class="prompt"></span><span class="completion"></span></div>
<script>
const $ = (id) => document.getElementById(id);
let controller = null;

function request() {
  const body = {prompt: $("prompt").value, max_tokens: parseInt($("max_tokens").value, 10),
                temperature: parseFloat($("temperature").value), top_p: parseFloat($("top_p").value),
                top_k: parseInt($("top_k").value, 10) || 0, stream: true,
                stream_options: {include_usage: true}};
  if ($("seed").value !== "") body.seed = parseInt($("seed").value, 10);
  const stop = $("stop").value.replace(/\\\\n/g, "\\n");
  if (stop) body.stop = stop;
  return body;
}

async function generate() {
  $("error").textContent = "";
  document.querySelector("#output .prompt").textContent = $("prompt").value;
  const out = document.querySelector("#output .completion");
  out.textContent = "";
  $("count").textContent = "0"; $("rate").textContent = "0.0"; $("state").textContent = "(waiting)";
  $("generate").disabled = true; $("stopbtn").disabled = false;
  controller = new AbortController();
  let pieces = 0, first = null, usage = null;
  try {
    const resp = await fetch("/v1/completions", {method: "POST", headers: {"Content-Type": "application/json"},
                                                 body: JSON.stringify(request()), signal: controller.signal});
    if (!resp.ok) { $("error").textContent = (await resp.json()).error; return; }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\\n\\n")) >= 0) {
        const line = buffer.slice(0, end).trim(); buffer = buffer.slice(end + 2);
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const event = JSON.parse(data);
        if (event.error) { $("error").textContent = event.error; continue; }
        if (event.usage) usage = event.usage;
        for (const c of event.choices || []) {
          if (c.text) {
            out.textContent += c.text;
            pieces += 1;
            if (first === null) first = performance.now();
          }
          if (c.finish_reason) $("state").textContent = "(" + c.finish_reason + ")";
        }
        const count = usage ? usage.completion_tokens : pieces;
        $("count").textContent = String(count);
        if (first !== null) {
          const seconds = (performance.now() - first) / 1000;
          if (seconds > 0) $("rate").textContent = (count / seconds).toFixed(1);
        }
      }
    }
  } catch (err) {
    if (err.name !== "AbortError") $("error").textContent = String(err);
  } finally {
    $("generate").disabled = false; $("stopbtn").disabled = true; controller = null;
  }
}
$("generate").addEventListener("click", generate);
$("stopbtn").addEventListener("click", () => controller && controller.abort());
</script>
</body>
</html>
"""
