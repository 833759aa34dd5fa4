// The playground's calls to the server, as any OpenAI client makes them: the API key (kept for this
// tab only), JSON requests, server-sent event streams read chunk by chunk, token texts, and the same
// request written out as curl or OpenAI SDK code.

const KEY = "jaxserve.apiKey";

export class Unauthorized extends Error {}

export class RequestFailed extends Error {}

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setApiKey(key) {
  sessionStorage.setItem(KEY, key.trim());
}

function headers() {
  const h = {"Content-Type": "application/json"};
  if (apiKey()) h.Authorization = `Bearer ${apiKey()}`;
  return h;
}

async function failure(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    message = (await response.json()).error?.message || message;
  } catch { /* not OpenAI's error body */ }
  return response.status === 401 ? new Unauthorized(message) : new RequestFailed(message);
}

async function call(path, init) {
  const response = await fetch(path, {headers: headers(), ...init});
  if (!response.ok) throw await failure(response);
  return response;
}

export async function getJSON(path) {
  return (await call(path)).json();
}

export async function postJSON(path, body) {
  return (await call(path, {method: "POST", body: JSON.stringify(body)})).json();
}

// Each event's JSON, as it arrives, until [DONE]; an error event is thrown.
export async function* stream(path, body, signal) {
  const response = await call(path, {method: "POST", body: JSON.stringify(body), signal});
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value.replaceAll("\r\n", "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n").filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart()).join("\n");
      buffer = buffer.slice(end + 2);
      if (data === "[DONE]") return;
      if (!data) continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new RequestFailed(chunk.error.message);
      yield chunk;
    }
  }
}

// Token id -> text. Chat logprobs carry each token's bytes; the completions form names alternatives by
// id only (return_tokens_as_token_ids), so their text is asked of /detokenize when first shown.
const texts = new Map();

export function tokenId(name) {
  return Number(name.slice("token_id:".length));
}

export function knowText(id, text) {
  texts.set(id, text);
}

export async function tokenText(id) {
  if (!texts.has(id)) {
    texts.set(id, postJSON("detokenize", {tokens: [id]}).then((r) => r.prompt, () => {
      texts.delete(id);  // (asked again next time)
      return `token_id:${id}`;
    }));
  }
  return texts.get(id);
}

// The OpenAI SDK's own arguments of each endpoint; the others go in extra_body.
const SDK_ARGUMENTS = {
  "v1/chat/completions": ["model", "messages", "stream", "stream_options", "temperature", "top_p", "max_tokens",
    "seed", "n", "presence_penalty", "frequency_penalty", "stop", "logit_bias", "response_format", "logprobs",
    "top_logprobs"],
  "v1/completions": ["model", "prompt", "stream", "stream_options", "temperature", "top_p", "max_tokens", "seed",
    "n", "presence_penalty", "frequency_penalty", "stop", "logit_bias", "logprobs", "echo"],
};

export function curl(path, body) {
  const json = JSON.stringify(body, null, 2).replaceAll("'", "'\\''");
  const key = apiKey() ? ` \\\n  -H "Authorization: Bearer $OPENAI_API_KEY"` : "";
  return `curl -N ${new URL(path, document.baseURI)} \\\n  -H "Content-Type: application/json"${key} \\\n  -d '${json}'`;
}

function py(value, indent) {
  if (value === null || value === undefined) return "None";
  if (typeof value === "boolean") return value ? "True" : "False";
  if (typeof value !== "object") return JSON.stringify(value);  // (JSON's numbers and strings are Python's)
  const inner = `${indent}    `;
  const items = Array.isArray(value) ? value.map((v) => py(v, inner))
    : Object.entries(value).map(([k, v]) => `${JSON.stringify(k)}: ${py(v, inner)}`);
  const [open, close] = Array.isArray(value) ? ["[", "]"] : ["{", "}"];
  return items.length ? `${open}\n${items.map((item) => `${inner}${item},\n`).join("")}${indent}${close}` : open + close;
}

export function python(path, body) {
  const own = SDK_ARGUMENTS[path];
  const args = Object.entries(body).filter(([k]) => own.includes(k)).map(([k, v]) => `    ${k}=${py(v, "    ")},\n`);
  const extra = Object.fromEntries(Object.entries(body).filter(([k]) => !own.includes(k)));
  if (Object.keys(extra).length) args.push(`    extra_body=${py(extra, "    ")},\n`);
  const method = path === "v1/chat/completions" ? "chat.completions" : "completions";
  const piece = path === "v1/chat/completions" ? "delta.content" : "text";
  const key = apiKey() ? 'os.environ["OPENAI_API_KEY"]' : '"EMPTY"';
  return `import os\n\nfrom openai import OpenAI\n\nclient = OpenAI(base_url="${new URL("v1", document.baseURI)}", api_key=${key})\n`
    + `stream = client.${method}.create(\n${args.join("")})\n`
    + `for chunk in stream:\n    if chunk.choices:\n        print(chunk.choices[0].${piece} or "", end="", flush=True)\n`;
}
