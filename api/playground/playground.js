// The playground page: chat and completion modes over the served model, the sampling panel, and the
// answers with their branches. An answer is a message whose branches each hold its choices (n of them
// side by side); regenerating adds a branch, and so does choosing another token at some position:
// that branch keeps the tokens before it, forces the chosen one, and has the rest generated anew
// (a completions request from the prompt's token ids).

import * as api from "./api.js";
import {ChoiceView} from "./tokens.js";

const $ = (id) => document.getElementById(id);
const STORE = "jaxserve.playground";

// The sampling panel: each field is sent when set (empty: the server's default).
const FIELDS = [
  {name: "temperature", label: "Temperature", min: 0, max: 2, step: 0.05},
  {name: "top_p", label: "Top p", min: 0, max: 1, step: 0.01},
  {name: "top_k", label: "Top k", int: true, min: -1},
  {name: "min_p", label: "Min p", min: 0, max: 1, step: 0.01},
  {name: "max_tokens", label: "Max tokens", int: true, min: 1, initial: "256"},
  {name: "seed", label: "Seed", int: true},
  {name: "n", label: "Choices (n)", int: true, min: 1},
  {name: "presence_penalty", label: "Presence penalty", min: -2, max: 2, step: 0.1},
  {name: "frequency_penalty", label: "Frequency penalty", min: -2, max: 2, step: 0.1},
  {name: "repetition_penalty", label: "Repetition penalty", min: 0.01, max: 100, step: 0.05},
  {name: "stop", label: "Stop strings (one a line)", kind: "lines"},
  {name: "logit_bias", label: "Logit bias (JSON, token id → bias)", kind: "json", placeholder: '{"42": -100}'},
  {name: "top_logprobs", label: "Alternatives shown per token", int: true, min: 0, max: 20, initial: "5"},
  {name: "min_tokens", label: "Min tokens", int: true, min: 0, more: true},
  {name: "ignore_eos", label: "Ignore end of sequence", kind: "bool", more: true},
  {name: "typical_p", label: "Typical p", min: 0, max: 1, step: 0.01, more: true},
  {name: "top_n_sigma", label: "Top-nσ", min: -1, max: 100, step: 0.1, more: true},
  {name: "xtc_probability", label: "XTC probability", min: 0, max: 1, step: 0.05, more: true},
  {name: "xtc_threshold", label: "XTC threshold", min: 0, max: 1, step: 0.05, more: true},
  {name: "dry_multiplier", label: "DRY multiplier", min: 0, max: 100, step: 0.1, more: true},
  {name: "dry_base", label: "DRY base", min: 1, max: 100, step: 0.05, more: true},
  {name: "dry_allowed_length", label: "DRY allowed length", int: true, min: 0, more: true},
  {name: "dry_penalty_last_n", label: "DRY last n", int: true, min: -1, more: true},
  {name: "mirostat", label: "Mirostat (0, 1 or 2)", int: true, min: 0, max: 2, more: true},
  {name: "mirostat_tau", label: "Mirostat τ", min: 0, max: 100, step: 0.1, more: true},
  {name: "mirostat_eta", label: "Mirostat η", min: 0, max: 1, step: 0.01, more: true},
  {name: "dynatemp_range", label: "Dynamic temperature range", min: 0, max: 2, step: 0.05, more: true},
  {name: "dynatemp_exponent", label: "Dynamic temperature exponent", min: 0, max: 100, step: 0.1, more: true},
  {name: "min_keep", label: "Min keep", int: true, min: 0, more: true},
];
const SCHEMA_TYPES = ["object", "array", "string", "number", "integer", "boolean", "null"];

const state = {
  mode: "chat",
  turns: {chat: [], completion: []},  // {role: "user" | "prompt", content} and {role: "assistant", message}
  running: null,  // the AbortController of the stream in flight
  model: null,
};

const testid = (name) => `setting-${name.replaceAll("_", "-")}`;

// ---- settings -------------------------------------------------------------------------------------

function buildSettings() {
  const form = $("settings");
  const more = document.createElement("details");
  more.innerHTML = "<summary>More samplers (llama.cpp's)</summary>";
  for (const field of FIELDS) {
    const row = document.createElement("div");
    row.className = field.kind === "bool" ? "field check" : "field";
    const label = document.createElement("label");
    label.htmlFor = testid(field.name);
    label.textContent = field.label;
    let input;
    if (field.kind === "lines" || field.kind === "json") {
      input = document.createElement("textarea");
      input.rows = 2;
    } else {
      input = document.createElement("input");
      input.type = field.kind === "bool" ? "checkbox" : "number";
      for (const key of ["min", "max"]) if (field[key] !== undefined) input[key] = field[key];
      if (field.kind !== "bool") input.step = field.int ? "1" : String(field.step ?? "any");
    }
    input.id = testid(field.name);
    input.name = field.name;
    input.dataset.testid = testid(field.name);
    input.placeholder = field.placeholder ?? (field.kind === "bool" ? "" : "default");
    const error = document.createElement("span");
    error.className = "field-error";
    error.id = `${input.id}-error`;
    input.setAttribute("aria-describedby", error.id);
    if (field.kind === "bool") row.append(input, label, error);
    else row.append(label, input, error);
    (field.more ? more : form).append(row);
  }
  form.append(responseFormatFields(), more);
  form.addEventListener("input", () => {
    checkSettings();
    save();
  });
}

function responseFormatFields() {
  const box = document.createElement("div");
  box.className = "field";
  box.innerHTML = `<label for="setting-response-format">Response format</label>
    <select id="setting-response-format" name="response_format" data-testid="setting-response-format">
      <option value="text">text</option><option value="json_object">JSON object</option>
      <option value="json_schema">JSON schema</option></select>
    <label for="setting-json-schema" class="schema">JSON schema</label>
    <textarea id="setting-json-schema" name="json_schema" class="schema" data-testid="setting-json-schema" rows="6"
      aria-describedby="setting-json-schema-error" spellcheck="false"></textarea>
    <span class="field-error" id="setting-json-schema-error" data-testid="schema-error"></span>`;
  box.querySelector("select").addEventListener("change", showSchema);
  return box;
}

function showSchema() {
  const shown = $("setting-response-format").value === "json_schema";
  for (const el of document.querySelectorAll(".schema")) el.hidden = !shown;
}

// A JSON schema's errors, as far as the page can tell (the server checks the rest and says why).
function schemaErrors(schema, path = "schema") {
  if (typeof schema === "boolean") return [];
  if (schema === null || typeof schema !== "object" || Array.isArray(schema)) return [`${path} must be an object`];
  const errors = [];
  const types = [schema.type ?? []].flat();
  for (const type of types) if (!SCHEMA_TYPES.includes(type)) errors.push(`${path}.type: unknown type ${JSON.stringify(type)}`);
  if (schema.required !== undefined && !(Array.isArray(schema.required) && schema.required.every((r) => typeof r === "string"))) {
    errors.push(`${path}.required must be a list of property names`);
  }
  if (schema.properties !== undefined) {
    if (typeof schema.properties !== "object" || Array.isArray(schema.properties)) errors.push(`${path}.properties must be an object`);
    else for (const [name, sub] of Object.entries(schema.properties)) errors.push(...schemaErrors(sub, `${path}.properties.${name}`));
  }
  if (schema.items !== undefined) errors.push(...schemaErrors(schema.items, `${path}.items`));
  return errors;
}

// The panel's values as request fields ({} where unset), and each field's error shown beside it.
function checkSettings() {
  const values = {};
  let ok = true;
  const fail = (input, message) => {
    $(`${input.id}-error`).textContent = message;
    input.setAttribute("aria-invalid", String(Boolean(message)));
    if (message) ok = false;
  };
  for (const field of FIELDS) {
    const input = $(testid(field.name));
    const raw = input.value.trim();
    let message = "";
    if (field.kind === "bool") {
      if (input.checked) values[field.name] = true;
    } else if (field.kind === "lines") {
      const lines = input.value.split("\n").filter((line) => line !== "");
      if (lines.length) values[field.name] = lines;
    } else if (field.kind === "json") {
      if (raw) {
        try {
          const bias = JSON.parse(raw);
          if (typeof bias !== "object" || bias === null || Array.isArray(bias)) throw new Error("an object");
          for (const [id, value] of Object.entries(bias)) {
            if (!/^\d+$/.test(id)) throw new Error(`token ids as keys, not ${JSON.stringify(id)}`);
            if (typeof value !== "number" || value < -100 || value > 100) throw new Error("biases from -100 to 100");
          }
          values[field.name] = bias;
        } catch (e) {
          message = `needs ${e.message}`;
        }
      }
    } else if (input.validity.badInput) {
      message = "a number";
    } else if (raw) {
      const value = Number(raw);
      if (!Number.isFinite(value) || (field.int && !Number.isInteger(value))) message = field.int ? "a whole number" : "a number";
      else if (field.min !== undefined && value < field.min) message = `at least ${field.min}`;
      else if (field.max !== undefined && value > field.max) message = `at most ${field.max}`;
      else values[field.name] = value;
    }
    fail(input, message);
  }
  const format = $("setting-response-format").value;
  const schemaInput = $("setting-json-schema");
  let schemaMessage = "";
  if (format === "json_object") values.response_format = {type: "json_object"};
  if (format === "json_schema") {
    try {
      const schema = JSON.parse(schemaInput.value);
      const errors = schemaErrors(schema);
      if (errors.length) schemaMessage = errors.join("; ");
      else values.response_format = {type: "json_schema", json_schema: {name: "answer", schema, strict: true}};
    } catch (e) {
      schemaMessage = `not JSON: ${e.message}`;
    }
  }
  fail(schemaInput, schemaMessage);
  return ok ? values : null;
}

function save() {
  const fields = Object.fromEntries([...$("settings").elements].filter((el) => el.name)
    .map((el) => [el.name, el.type === "checkbox" ? el.checked : el.value]));
  localStorage.setItem(STORE, JSON.stringify({fields, mode: state.mode, system: $("system-prompt").value}));
}

function restore() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(STORE)) || {};
  } catch { /* a value from elsewhere: start afresh */ }
  for (const el of $("settings").elements) {
    if (!el.name) continue;
    const value = saved.fields?.[el.name] ?? FIELDS.find((f) => f.name === el.name)?.initial;
    if (value === undefined) continue;
    if (el.type === "checkbox") el.checked = Boolean(value);
    else el.value = value;
  }
  $("system-prompt").value = saved.system ?? "";
  showSchema();
  setMode(saved.mode === "completion" ? "completion" : "chat");
}

// ---- requests -------------------------------------------------------------------------------------

// What every request asks besides the settings: a stream with each token's logprobs, alternatives
// and entropy, tokens named by id (branching needs the ids).
function requestBody(settings, head) {
  const {top_logprobs: alternatives = 5, ...sampling} = settings;
  const body = {model: state.model, ...head, ...sampling, stream: true, stream_options: {include_usage: true}};
  if (head.messages) Object.assign(body, {logprobs: true, top_logprobs: alternatives});
  else body.logprobs = alternatives;
  return Object.assign(body, {return_tokens_as_token_ids: true, return_entropy: true});
}

function chatMessages(turns) {
  const system = $("system-prompt").value;
  const messages = system ? [{role: "system", content: system}] : [];
  for (const turn of turns) {
    if (turn.role === "user") messages.push({role: "user", content: turn.content});
    if (turn.role === "assistant") messages.push({role: "assistant", content: selectedChoice(turn.message)?.content ?? ""});
  }
  return messages;
}

// The request Send would make now: [path, body], or null (with the reason shown) where it cannot.
function nextRequest() {
  const settings = checkSettings();
  if (!settings) return fail("Some settings are not valid: see the sampling panel.");
  const text = $("prompt-input").value;
  if (state.mode === "completion") return ["v1/completions", requestBody(settings, {prompt: text})];
  const turns = text ? [...state.turns.chat, {role: "user", content: text}] : state.turns.chat;
  if (turns.at(-1)?.role !== "user") return fail("Write a message first.");
  return ["v1/chat/completions", requestBody(settings, {messages: chatMessages(turns)})];
}

function fail(message) {
  $("error").textContent = message;
  return null;
}

function copy(format) {
  const request = nextRequest();
  if (!request) return;
  const code = format === "curl" ? api.curl(...request) : api.python(...request);
  $("code-title").textContent = format === "curl" ? "The request, as curl" : "The request, with the OpenAI SDK";
  $("code-output").textContent = code;
  $("code-status").textContent = "";
  $("code-dialog").showModal();
  navigator.clipboard?.writeText(code).then(
    () => { $("code-status").textContent = "Copied to the clipboard."; },
    () => { $("code-status").textContent = "Select the text below to copy it."; });
}

// ---- answers --------------------------------------------------------------------------------------

function newChoice(tokens = []) {
  return {tokens, content: "", finish: null, decoder: new TextDecoder(), chars: [], open: null, view: null};
}

function selectedChoice(message) {
  const branch = message.branches[message.current];
  return branch.choices[branch.selected];
}

// A stream's chunk into the branch's choices: chat chunks carry each token's bytes, completions
// chunks name tokens by id and place them in the text by offset.
// Returns whether a choice first appeared (it then needs a view).
function record(branch, chunk) {
  let appeared = false;
  for (const part of chunk.choices ?? []) {
    appeared ||= !branch.choices[part.index];
    const choice = branch.choices[part.index] ?? (branch.choices[part.index] = newChoice());
    const added = part.delta ? chatTokens(choice, part) : completionTokens(choice, part);
    added.forEach((tok, i) => {
      tok.index = choice.tokens.length + i;
      if (part.entropies) tok.entropy = part.entropies[i];
    });
    choice.tokens.push(...added);
    choice.finish = part.finish_reason ?? choice.finish;
    choice.view?.add(added);
    if (part.delta && part.finish_reason === "stop") hideEnd(choice);
  }
  return appeared;
}

// A chat answer's last token where the answer does not end with its text: the end-of-turn token (its
// bytes name it: "<|im_end|>") or a stop string's, neither of them the answer's. It shows no text, as
// in the completions form, where a token's text is the answer's from its offset.
function hideEnd(choice) {
  const last = choice.tokens.at(-1);
  if (!last?.text || choice.content.endsWith(last.text)) return;
  last.text = "";
  choice.view?.retext(last);
}

function alternatives(id, prob, top) {
  const alts = top.some((alt) => alt.id === id) ? top : [...top, {id, prob, text: null}];
  return alts.sort((a, b) => b.prob - a.prob);
}

function chatTokens(choice, part) {
  choice.content += part.delta.content ?? "";
  return (part.logprobs?.content ?? []).map((entry) => {
    const id = api.tokenId(entry.token);
    const text = choice.decoder.decode(new Uint8Array(entry.bytes ?? []), {stream: true});
    const top = (entry.top_logprobs ?? []).map((alt) => {
      const altText = new TextDecoder().decode(new Uint8Array(alt.bytes ?? []));
      api.knowText(api.tokenId(alt.token), altText);
      return {id: api.tokenId(alt.token), prob: Math.exp(alt.logprob), text: altText};
    });
    const prob = Math.exp(entry.logprob);
    return {id, text, prob, alts: alternatives(id, prob, top).map((alt) => (alt.id === id ? {...alt, text: alt.text ?? text} : alt))};
  });
}

// A token's text runs from its offset to the next token's. The server may hold back text that could
// begin a stop string, so the last token of a chunk stays open until more text or the next token comes.
function completionTokens(choice, part) {
  choice.content += part.text ?? "";
  choice.chars.push(...Array.from(part.text ?? ""));
  const lp = part.logprobs;
  const close = (tok, end) => {
    tok.text = choice.chars.slice(tok.offset, end).join("");
    tok.alts = tok.alts.map((alt) => (alt.id === tok.id ? {...alt, text: tok.text} : alt));
  };
  if (choice.open) {
    close(choice.open, lp?.text_offset[0] ?? choice.chars.length);
    choice.view?.retext(choice.open);
    if (lp) choice.open = null;
  }
  if (!lp) return [];
  const added = lp.tokens.map((name, i) => {
    const id = api.tokenId(name);
    const prob = Math.exp(lp.token_logprobs[i]);
    const top = Object.entries(lp.top_logprobs[i] ?? {}).map(([alt, logprob]) => ({id: api.tokenId(alt), prob: Math.exp(logprob), text: null}));
    const tok = {id, prob, offset: lp.text_offset[i], alts: alternatives(id, prob, top)};
    close(tok, i + 1 < lp.tokens.length ? lp.text_offset[i + 1] : choice.chars.length);
    return tok;
  });
  choice.open = added.at(-1) ?? null;
  return added;
}

function describe(choice, usage) {
  const why = {stop: "stopped", length: "reached max tokens", abort: "aborted by the server", stopped: "stopped by you"};
  return `${choice.tokens.length} tokens${choice.finish ? ` · ${why[choice.finish] ?? choice.finish}` : ""}`
    + (usage ? ` · prompt ${usage.prompt_tokens} tokens` : "");
}

// One generation at a time: Send, Regenerate and the alternatives do nothing while one runs.
function begin() {
  if (state.running) return null;
  state.running = new AbortController();
  busy(true);
  $("error").textContent = "";
  return state.running;
}

function end() {
  state.running = null;
  busy(false);
  render();
}

// Streams a request into `branch` of `message`: tokens appear as they come; Stop aborts it. A request
// that fails before its first chunk leaves no branch behind.
async function generate(message, branch, path, body, controller) {
  const box = $("messages");
  let started = null;
  let count = 0;
  let answered = false;
  try {
    for await (const chunk of api.stream(path, body, controller.signal)) {
      answered = true;
      const pinned = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
      if (record(branch, chunk)) render();
      if (pinned) box.scrollTop = box.scrollHeight;
      if (chunk.usage) branch.usage = chunk.usage;
      count += (chunk.choices ?? []).reduce((sum, c) => sum + (c.logprobs?.content?.length ?? c.logprobs?.tokens?.length ?? 0), 0);
      started ??= count ? performance.now() : null;
      const seconds = started === null ? 0 : (performance.now() - started) / 1000;
      if (seconds > 0) $("tokens-per-second").textContent = `${((count - 1) / seconds).toFixed(1)} tokens/s`;
    }
  } catch (e) {
    if (e.name !== "AbortError") report(e);
    for (const choice of branch.choices.filter(Boolean)) choice.finish ??= e.name === "AbortError" ? "stopped" : "error";
  } finally {
    controller.abort();  // (a stream left early is closed, so the server frees its pages)
    for (const choice of branch.choices.filter(Boolean)) {
      if (branch.prefix !== undefined) choice.content = branch.prefix + choice.content;
      choice.view?.finish(describe(choice, branch.usage));
    }
    branch.choices = branch.choices.filter(Boolean);
    delete branch.prefix;
    message.streaming = false;
    if (!answered) drop(message, branch);
  }
}

function report(e) {
  if (e instanceof api.Unauthorized) askKey();
  $("error").textContent = e.message;
}

function busy(on) {
  $("send-button").disabled = on;
  $("stop-button").disabled = !on;
  for (const el of document.querySelectorAll(".message-actions button, .choice > button")) el.disabled = on;
}

async function send() {
  const request = nextRequest();
  if (!request) return;
  const controller = begin();
  if (!controller) return;
  const [path, body] = request;
  const turns = state.turns[state.mode];
  const text = $("prompt-input").value;
  const asked = state.mode === "completion" || text ? {role: state.mode === "chat" ? "user" : "prompt", content: text} : null;
  if (asked) turns.push(asked);
  $("prompt-input").value = "";
  const head = body.messages ? {messages: body.messages} : {prompt: body.prompt};
  const message = {path, head, asked, branches: [], current: 0, promptIds: null, view: null};
  turns.push({role: "assistant", message});
  await run(message, newBranch(), path, body, controller);
}

function newBranch(from = null, choices = []) {
  return {choices, selected: 0, from, after: [], previous: 0};
}

// Adds `branch` to `message` (the turns after the message stay with the branch they followed) and runs it.
async function run(message, branch, path, body, controller) {
  const turns = state.turns[state.mode];
  const at = turns.findIndex((t) => t.message === message);
  if (message.branches.length) message.branches[message.current].after = turns.splice(at + 1);
  branch.previous = message.current;
  message.branches.push(branch);
  message.current = message.branches.length - 1;
  message.streaming = Boolean(path);
  render();
  try {
    if (path) await generate(message, branch, path, body, controller);
  } finally {
    end();
  }
}

// A branch that never got an answer is taken back, and the one shown before it comes back with its
// turns; a first answer is taken back with the message or prompt it answered, put back in the input.
function drop(message, branch) {
  const turns = state.turns[state.mode];
  message.branches.splice(message.branches.indexOf(branch), 1);
  if (!message.branches.length) {
    turns.splice(turns.findIndex((t) => t.message === message), 1);
    if (message.asked && turns.at(-1) === message.asked) {
      turns.pop();
      $("prompt-input").value ||= message.asked.content;
    }
    return;
  }
  message.current = Math.min(branch.previous, message.branches.length - 1);
  turns.push(...message.branches[message.current].after);
}

// The same prompt again, with the settings as they are now.
function regenerate(message) {
  const settings = checkSettings();
  if (!settings) return fail("Some settings are not valid: see the sampling panel.");
  const controller = begin();
  if (controller) run(message, newBranch(), message.path, requestBody(settings, message.head), controller);
}

// The answer again from token `index` of choice `c`, with `alt` there instead, under the settings as they
// are now (as a completions request from the prompt's token ids).
async function branchFrom(message, c, index, alt) {
  const settings = checkSettings();
  if (!settings) return fail("Some settings are not valid: see the sampling panel.");
  const controller = begin();
  if (!controller) return;
  const source = message.branches[message.current].choices[c];
  const kept = source.tokens.slice(0, index).map((tok) => ({...tok, forced: false}));
  const ids = [...kept.map((tok) => tok.id), alt.id];
  let prefix;
  try {
    if (!message.promptIds) {
      const tokenized = await api.postJSON("tokenize", message.head.messages
        ? {model: state.model, messages: message.head.messages, add_generation_prompt: true}
        : {model: state.model, prompt: message.head.prompt});
      message.promptIds = tokenized.tokens;
      message.maxModelLen = tokenized.max_model_len;
    }
    prefix = (await api.postJSON("detokenize", {model: state.model, tokens: ids})).prompt;  // (decoded together)
  } catch (e) {
    report(e);
    return end();
  }
  const forced = {id: alt.id, text: alt.text, prob: alt.prob, alts: source.tokens[index].alts, forced: true, index,
    entropy: source.tokens[index].entropy};
  // (a grammar would start over at the branch's first new token: branches are not constrained)
  const branch = newBranch({index, text: alt.text, free: "response_format" in settings}, [newChoice([...kept, forced])]);
  branch.prefix = prefix;
  const {n, response_format, ...sampling} = settings;
  const body = requestBody(sampling, {prompt: [...message.promptIds, ...ids]});
  // max_tokens counts the tokens kept and the chosen one; unset, the original's default
  // (chat: the rest of the context; completions: 16)
  const budget = sampling.max_tokens ?? (message.head.messages ? message.maxModelLen - message.promptIds.length : 16);
  body.max_tokens = budget - index - 1;
  if (body.min_tokens !== undefined) body.min_tokens = Math.max(0, body.min_tokens - index - 1);
  if (body.max_tokens < 1) {  // (the forced token was the last one allowed)
    Object.assign(branch.choices[0], {finish: "length", content: branch.prefix});
    delete branch.prefix;
    return run(message, branch, null, null, controller);
  }
  await run(message, branch, "v1/completions", body, controller);
}

// ---- rendering ------------------------------------------------------------------------------------

function button(text, testid, onClick, disabled = false) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = text;
  b.dataset.testid = testid;
  b.disabled = disabled || state.running !== null;
  b.addEventListener("click", onClick);
  return b;
}

function renderMessage(message) {
  const el = document.createElement("article");
  el.className = "message assistant";
  el.dataset.testid = "message-assistant";
  el.setAttribute("aria-label", "Answer");
  if (message.streaming) el.dataset.streaming = "true";
  message.view = {el};
  const branch = message.branches[message.current];
  const actions = document.createElement("div");
  actions.className = "message-actions";
  const last = message.branches.length - 1;
  actions.append(button("◀", "branch-prev", () => switchBranch(message, message.current - 1), message.current === 0));
  const label = document.createElement("span");
  label.dataset.testid = "branch-label";
  label.textContent = `branch ${message.current + 1} of ${message.branches.length}`
    + (branch.from ? ` · from token ${branch.from.index + 1} “${branch.from.text}”` : "")
    + (branch.from?.free ? " · without the response format" : "");
  actions.append(label, button("▶", "branch-next", () => switchBranch(message, message.current + 1), message.current === last));
  actions.append(button("Regenerate", "regenerate-button", () => regenerate(message)));
  const choices = document.createElement("div");
  choices.className = "choices";
  branch.choices.forEach((choice, c) => {
    const view = new ChoiceView((index, alt) => branchFrom(message, c, index, alt));
    choice.view = view;
    view.add(choice.tokens);
    if (branch.choices.length > 1 && state.mode === "chat") {
      const pick = button(branch.selected === c ? "✓ continued from" : "Continue from this one", "choose-choice", () => {
        branch.selected = c;
        render();
      }, branch.selected === c);
      view.el.prepend(pick);
    }
    if (state.running === null || choice.finish) view.finish(describe(choice, branch.usage));
    choices.append(view.el);
  });
  el.append(actions, choices);
  return el;
}

function switchBranch(message, k) {
  const turns = state.turns[state.mode];
  const at = turns.findIndex((t) => t.message === message);
  message.branches[message.current].after = turns.splice(at + 1);
  message.current = k;
  turns.push(...message.branches[k].after);
  render();
}

// Where the focus is among the answers, to put it back on the same control once they are drawn again.
function focused() {
  const el = document.activeElement;
  const article = el?.closest?.("#messages article");
  if (!article || !el.dataset.testid) return null;
  const same = (root) => [...root.querySelectorAll(`[data-testid="${el.dataset.testid}"]`)];
  return {at: [...$("messages").querySelectorAll("article")].indexOf(article), testid: el.dataset.testid,
    nth: same(article).indexOf(el), same};
}

function refocus(where) {
  const article = where && $("messages").querySelectorAll("article")[where.at];
  const target = article && where.same(article)[where.nth];
  if (target && !target.disabled) target.focus();
}

function render() {
  const box = $("messages");
  const scrolled = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
  const where = focused();
  box.replaceChildren();
  for (const turn of state.turns[state.mode]) {
    if (turn.role === "assistant") {
      box.append(renderMessage(turn.message));
      continue;
    }
    const el = document.createElement("div");
    el.className = `message ${turn.role}`;
    el.dataset.testid = turn.role === "user" ? "message-user" : "message-prompt";
    el.textContent = turn.content;
    box.append(el);
  }
  if (scrolled) box.scrollTop = box.scrollHeight;
  refocus(where);
}

function setMode(mode) {
  if (state.running) return;
  state.mode = mode;
  $("mode-chat").setAttribute("aria-pressed", String(mode === "chat"));
  $("mode-completion").setAttribute("aria-pressed", String(mode === "completion"));
  $("system-box").hidden = mode !== "chat";
  $("prompt-label").textContent = mode === "chat" ? "Message" : "Prompt (raw text, no chat template)";
  $("send-hint").textContent = mode === "chat" ? "Enter sends, Shift+Enter a new line" : "Ctrl+Enter sends";
  $("send-button").textContent = mode === "chat" ? "Send" : "Generate";
  render();
}

// ---- the server -----------------------------------------------------------------------------------

async function connect() {
  try {
    const card = (await api.getJSON("v1/models")).data[0];
    state.model = card.id;
    $("model-name").textContent = card.id;
    $("context-length").textContent = card.max_model_len ? `context ${card.max_model_len} tokens` : "";
    $("error").textContent = "";
  } catch (e) {
    $("model-name").textContent = "not connected";
    report(e);
  }
}

function askKey() {
  if (!$("key-dialog").open) $("key-dialog").showModal();
}

function start() {
  buildSettings();
  restore();
  checkSettings();
  $("mode-chat").addEventListener("click", () => { setMode("chat"); save(); });
  $("mode-completion").addEventListener("click", () => { setMode("completion"); save(); });
  $("system-prompt").addEventListener("input", save);
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    if (!state.running) send();
  });
  $("prompt-input").addEventListener("keydown", (e) => {
    const sends = state.mode === "chat" ? !e.shiftKey && !e.ctrlKey : e.ctrlKey || e.metaKey;
    if (e.key === "Enter" && sends && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop-button").addEventListener("click", () => state.running?.abort());
  $("clear-button").addEventListener("click", () => {
    if (state.running) return;
    state.turns[state.mode] = [];
    render();
  });
  $("copy-curl").addEventListener("click", () => copy("curl"));
  $("copy-python").addEventListener("click", () => copy("python"));
  $("key-form").addEventListener("submit", () => {
    api.setApiKey($("api-key-input").value);
    connect();
  });
  $("key-button").addEventListener("click", askKey);
  $("key-button").hidden = document.body.dataset.apiKey !== "required";
  if (document.body.dataset.apiKey === "required" && !api.apiKey()) askKey();
  else connect();
}

start();
