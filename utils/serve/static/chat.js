// The chat page of `python main.py serve`: plain JavaScript, no build step, no network but
// this server. Chat models (SFT) go through /v1/chat/completions with the whole conversation;
// pre-trained models continue the text through /v1/completions. Replies stream (SSE).
// Tools: an OpenAI tools list pasted under "Tools" goes with each chat request (with the tool
// choice and whether several calls may come in one reply); a call the model
// makes is shown (name and arguments) and the next message typed is its result (a "tool" turn),
// after which the model answers.
"use strict";
const $ = (id) => document.getElementById(id);
// conversation: which conversation a reply belongs to (Clear and a model change start another)
// pending: tool calls of the last reply still waiting for the result the user types
const state = { models: [], messages: [], controller: null, conversation: 0, pending: [] };

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.appendChild(body);
  $("log").appendChild(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

async function loadModels() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
    state.models = body.data;
    const sel = $("model");
    sel.innerHTML = "";
    for (const m of state.models) {
      const o = document.createElement("option");
      o.value = m.id;
      o.textContent = m.id + (m.chat ? " (chat)" : " (completion)");
      sel.appendChild(o);
    }
    $("status").textContent = state.models.length + " model(s)";
  } catch (e) {
    $("status").textContent = "could not list models: " + e.message;
  }
}

function currentModel() {
  return state.models.find((m) => m.id === $("model").value);
}

function readTools() {
  const raw = $("tools").value.trim();
  if (!raw) return null;
  const tools = JSON.parse(raw);                  // a SyntaxError is shown as the send's error
  if (!Array.isArray(tools)) throw new Error("Tools must be a JSON list of {\"type\": \"function\", ...}");
  return tools;
}

async function send(text) {
  const m = currentModel();
  if (!m) { $("status").textContent = "no model selected"; return; }
  if (m.chat && state.pending.length) {           // the result of the call shown last
    const call = state.pending.shift();
    bubble("tool", call.function.name + " \u2192 " + text);
    state.messages.push({ role: "tool", tool_call_id: call.id, content: text });
    if (state.pending.length) {
      $("status").textContent = "type the result of " + state.pending[0].function.name;
      return;
    }
    return ask(m, null);
  }
  bubble("user", text);
  if (m.chat) state.messages.push({ role: "user", content: text });
  return ask(m, text);
}

async function ask(m, text) {
  const reply = bubble("assistant", "");
  const out = reply.querySelector(".text");
  const chat = m.chat, conversation = state.conversation;
  const body = { model: m.id, stream: true, stream_options: { include_usage: true } };
  const calls = [];
  for (const [field, id] of [["temperature", "temperature"], ["max_tokens", "max-tokens"]]) {
    const v = $(id).value.trim();
    if (v !== "") body[field] = Number(v);        // empty: the server's default
  }
  if (chat) body.messages = state.messages; else body.prompt = text;
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const t0 = performance.now();
  let first = null, tokens = 0, reason = null, stopped = false, failed = null;
  try {
    const tools = chat ? readTools() : null;
    if (tools) {
      body.tools = tools;
      body.tool_choice = $("tool-choice").value;
      body.parallel_tool_calls = $("parallel-calls").checked;    // off: at most one call per reply
    }
    const r = await fetch(chat ? "/v1/chat/completions" : "/v1/completions",
      { method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error(err.error ? err.error.message : r.status + " " + r.statusText);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const line = buf.slice(0, cut).trim();
        buf = buf.slice(cut + 2);
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") continue;
        const ev = JSON.parse(data);
        if (ev.error) { failed = ev.error.message; continue; }
        if (ev.usage) tokens = ev.usage.completion_tokens;
        for (const c of ev.choices || []) {
          const piece = chat ? (c.delta && c.delta.content) || "" : c.text || "";
          if (piece) {
            if (first === null) first = performance.now();
            out.textContent += piece;
            $("log").scrollTop = $("log").scrollHeight;
          }
          for (const d of (chat && c.delta && c.delta.tool_calls) || []) {   // joined by index
            const call = calls[d.index] || (calls[d.index] = { id: d.id, type: "function",
                                                               function: { name: "", arguments: "" } });
            if (d.id) call.id = d.id;
            if (d.function && d.function.name) call.function.name += d.function.name;
            if (d.function && d.function.arguments) call.function.arguments += d.function.arguments;
          }
          if (c.finish_reason) reason = c.finish_reason;
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") stopped = true; else failed = e.message;
  } finally {
    state.controller = null;
    setBusy(false);
  }
  if (chat && conversation === state.conversation) {     // not after a Clear or a model change
    if (calls.length && !failed) {
      state.messages.push({ role: "assistant", content: out.textContent || null, tool_calls: calls });
      for (const c of calls) {
        const shown = bubble("call", c.function.name + "(" + c.function.arguments + ")");
        shown.dataset.name = c.function.name;
      }
      state.pending = calls.slice();
      $("input").placeholder = "Type the result of " + calls[0].function.name;
    } else if (out.textContent || !failed) {
      state.messages.push({ role: "assistant", content: out.textContent });
    } else if (text !== null) {                // refused (too long, busy): the question leaves the
      state.messages.pop();                    // conversation and goes back to the input box
      if (!$("input").value) $("input").value = text;
    }
  }
  if (!state.pending.length) $("input").placeholder = "Type a message; Enter sends, Shift+Enter adds a line";
  if (failed) bubble("error", failed);
  if (calls.length && !out.textContent) reply.classList.add("calling");
  if (!failed && !stopped && reason === "stop" && !out.textContent) {
    out.textContent = chat ? "(the model ended its reply immediately: its first token was its end-of-turn token)"
                           : "(the model ended the text immediately: its first token was its end-of-text token)";
    out.classList.add("empty");
  }
  const secs = (performance.now() - t0) / 1000;
  const gen = first === null ? 0 : (performance.now() - first) / 1000;
  const rate = tokens > 1 && gen > 0 ? ((tokens - 1) / gen).toFixed(1) + " tokens/s" : "";
  const meta = document.createElement("span");
  meta.className = "meta";
  meta.textContent = [stopped ? "stopped" : reason && "finish: " + reason,
    tokens ? tokens + " tokens" : "", rate, secs.toFixed(2) + " s"].filter(Boolean).join(" · ");
  reply.appendChild(meta);
  $("log").scrollTop = $("log").scrollHeight;
  $("status").textContent = rate ? "last reply: " + rate : "";
}

$("form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("input").value.trim();
  if (!text || state.controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("form").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
$("clear").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.conversation += 1;
  state.messages = [];
  state.pending = [];
  $("log").innerHTML = "";
  $("status").textContent = "conversation cleared";
});
$("model").addEventListener("change", () => {
  state.conversation += 1;
  state.messages = [];
  state.pending = [];
  if (!$("log").children.length) return;
  const note = document.createElement("p");
  note.className = "note";
  note.textContent = "new conversation with " + $("model").value;
  $("log").appendChild(note);
});
$("api-key").addEventListener("change", loadModels);
loadModels();
