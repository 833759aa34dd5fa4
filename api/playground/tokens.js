// The token view: each generated token an element coloured by its probability; pointing at it or
// focusing it shows its alternatives (top_logprobs), and choosing one asks for a branch from there;
// a small chart of probability and entropy along the answer.

import {tokenText} from "./api.js";

const SVG = "http://www.w3.org/2000/svg";

// Light backgrounds (red: unlikely, green: likely) under dark text keep the contrast readable.
export function probColour(p) {
  return `hsl(${Math.round(120 * p)} 70% 86%)`;
}

function visible(text) {
  return text.replaceAll(" ", "␣").replaceAll("\n", "↵").replaceAll("\t", "⇥") || "∅";
}

function percent(p) {
  return `${(100 * p).toFixed(p < 0.001 ? 3 : 1)}%`;
}

// One list of alternatives, moved next to the token it is shown for (so Tab reaches it from there).
class Alternatives {
  constructor() {
    this.el = document.createElement("div");
    this.el.className = "alternatives";
    this.el.dataset.testid = "alternatives";
    this.el.setAttribute("role", "group");
    this.el.hidden = true;
    this.token = null;
    this.hideTimer = 0;
    this.el.addEventListener("mouseenter", () => clearTimeout(this.hideTimer));
    this.el.addEventListener("mouseleave", () => this.hideSoon());
    this.el.addEventListener("focusout", (e) => this.leaving(e));
    this.el.addEventListener("keydown", (e) => this.key(e));
  }

  async show(tokenEl, tok, view) {
    clearTimeout(this.hideTimer);
    if (this.dismissed === tokenEl) return;  // (Escape hid it: the focus coming back does not reopen it)
    if (this.token === tokenEl && !this.el.hidden) return;
    this.token = tokenEl;
    const alts = await Promise.all(tok.alts.map(async (alt) => ({...alt, text: alt.text ?? await tokenText(alt.id)})));
    if (this.token !== tokenEl) return;
    this.el.replaceChildren();
    this.el.setAttribute("aria-label", `Alternatives for token ${tok.index + 1}`);
    const head = document.createElement("p");
    head.className = "alt-head";
    head.textContent = `token ${tok.index + 1}: p = ${tok.prob.toFixed(4)}`
      + (tok.entropy === undefined ? "" : `, entropy ${tok.entropy.toFixed(2)} nats`)
      + (tok.forced ? " (chosen here)" : "");
    this.el.append(head);
    for (const alt of alts) {
      const button = document.createElement("button");
      button.type = "button";
      button.tabIndex = -1;  // (reached with the arrow keys from the token)
      button.className = "alternative";
      button.dataset.testid = "alternative";
      button.dataset.prob = String(alt.prob);
      button.dataset.token = alt.text;
      button.dataset.tokenId = String(alt.id);
      const bar = document.createElement("span");
      bar.className = "alt-bar";
      bar.style.setProperty("--p", String(alt.prob));
      const label = document.createElement("span");
      label.className = "alt-text";
      label.textContent = visible(alt.text);
      const value = document.createElement("span");
      value.className = "alt-prob";
      value.textContent = percent(alt.prob);
      button.append(bar, label, value);
      if (alt.id === tok.id) {
        button.setAttribute("aria-current", "true");
        button.title = "the token generated here";
      } else {
        button.title = "regenerate from here with this token";
        button.addEventListener("click", () => {
          this.hide();
          view.onBranch(tok.index, {...alt});
        });
      }
      this.el.append(button);
    }
    tokenEl.after(this.el);
    const box = tokenEl.offsetParent;
    this.el.hidden = false;
    const left = Math.max(0, Math.min(tokenEl.offsetLeft, (box?.clientWidth ?? 0) - this.el.offsetWidth - 4));
    this.el.style.left = `${left}px`;
    this.el.style.top = `${tokenEl.offsetTop + tokenEl.offsetHeight + 2}px`;
  }

  hideSoon() {
    clearTimeout(this.hideTimer);
    this.hideTimer = setTimeout(() => this.hide(), 250);
  }

  hide() {
    clearTimeout(this.hideTimer);
    this.el.hidden = true;
    this.token = null;
  }

  dismiss(tokenEl) {
    this.hide();
    this.dismissed = tokenEl;
    tokenEl.focus();
    this.dismissed = null;
  }

  leaving(e) {
    if (!this.el.contains(e.relatedTarget) && e.relatedTarget !== this.token) this.hide();
  }

  key(e) {
    const buttons = [...this.el.querySelectorAll("button")];
    const at = buttons.indexOf(document.activeElement);
    if (e.key === "Escape" && this.token) {
      this.dismiss(this.token);
    } else if (e.key === "ArrowDown" || e.key === "ArrowUp") {
      e.preventDefault();
      buttons[(at + (e.key === "ArrowDown" ? 1 : buttons.length - 1)) % buttons.length]?.focus();
    }
  }
}

const alternatives = new Alternatives();

// One choice's tokens and chart; `onBranch(index, alternative)` is called when an alternative is chosen.
export class ChoiceView {
  constructor(onBranch) {
    this.onBranch = onBranch;
    this.tokens = [];
    this.el = document.createElement("div");
    this.el.className = "choice";
    this.el.dataset.testid = "choice";
    this.text = document.createElement("div");
    this.text.className = "tokens";
    this.chart = document.createElementNS(SVG, "svg");
    this.chart.classList.add("chart");
    this.chart.dataset.testid = "chart";
    this.chart.setAttribute("role", "img");
    this.chart.setAttribute("aria-label", "Probability (blue) and entropy (orange, dashed) of each token");
    this.chart.setAttribute("preserveAspectRatio", "none");
    this.probLine = document.createElementNS(SVG, "polyline");
    this.probLine.classList.add("prob-line");
    this.entropyLine = document.createElementNS(SVG, "polyline");
    this.entropyLine.classList.add("entropy-line");
    this.chart.append(this.probLine, this.entropyLine);
    this.footer = document.createElement("p");
    this.footer.className = "choice-footer";
    const legend = document.createElement("p");
    legend.className = "legend";
    legend.setAttribute("aria-hidden", "true");
    legend.innerHTML = '<span class="key prob">probability</span> <span class="key entropy">entropy</span>';
    this.el.append(this.text, this.chart, legend, this.footer);
    this.drawn = false;
  }

  add(toks) {
    for (const tok of toks) {
      const span = document.createElement("span");
      span.className = tok.forced ? "token forced" : "token";
      span.dataset.testid = "token";
      span.dataset.index = String(tok.index);
      span.dataset.prob = String(tok.prob);
      span.dataset.tokenId = String(tok.id);
      // One token of the answer is a Tab stop; the arrow keys move along the answer (a roving tabindex).
      span.tabIndex = this.tokens.length ? -1 : 0;
      span.setAttribute("role", "button");
      span.setAttribute("aria-description", `probability ${percent(tok.prob)}`);
      span.style.backgroundColor = probColour(tok.prob);
      this.retext(tok, span);
      span.addEventListener("mouseenter", () => alternatives.show(span, tok, this));
      span.addEventListener("mouseleave", () => alternatives.hideSoon());
      span.addEventListener("focus", () => {
        for (const other of this.text.querySelectorAll(".token[tabindex='0']")) other.tabIndex = -1;
        span.tabIndex = 0;
        alternatives.show(span, tok, this);
      });
      span.addEventListener("blur", (e) => { if (!alternatives.el.contains(e.relatedTarget)) alternatives.hide(); });
      span.addEventListener("keydown", (e) => this.key(e, span));
      this.text.append(span);
      this.tokens.push(tok);
    }
    this.redraw();
  }

  // A token's text, set again where it was completed later (text the server held back).
  retext(tok, span = this.text.querySelector(`.token[data-index="${tok.index}"]`)) {
    if (!span) return;
    span.dataset.token = tok.text;
    span.textContent = tok.text.replaceAll("\n", "↵\n");
    // (a token without text, as the end-of-turn token: a small block, named for screen readers)
    if (tok.text) span.removeAttribute("aria-label");
    else span.setAttribute("aria-label", "a token without text");
  }

  key(e, span) {
    const spans = [...this.text.querySelectorAll(".token")];
    const at = spans.indexOf(span);
    const to = {ArrowRight: at + 1, ArrowLeft: at - 1, Home: 0, End: spans.length - 1}[e.key];
    if (to !== undefined) {
      e.preventDefault();
      spans[Math.max(0, Math.min(to, spans.length - 1))].focus();
    } else if (e.key === "Enter" || e.key === " " || e.key === "ArrowDown") {
      e.preventDefault();
      alternatives.el.querySelector("button")?.focus();
    } else if (e.key === "Escape") {
      alternatives.dismiss(span);
    }
  }

  redraw() {
    if (this.drawn) return;
    this.drawn = true;
    requestAnimationFrame(() => {
      this.drawn = false;
      const n = this.tokens.length;
      this.chart.setAttribute("viewBox", `0 0 ${Math.max(n - 1, 1)} 100`);
      const entropies = this.tokens.map((t) => t.entropy).filter((h) => h !== undefined);
      const top = Math.max(1, ...entropies);
      this.probLine.setAttribute("points", this.tokens.map((t, i) => `${i},${100 - 98 * t.prob}`).join(" "));
      this.entropyLine.setAttribute("points", entropies.length === n
        ? this.tokens.map((t, i) => `${i},${100 - 98 * t.entropy / top}`).join(" ") : "");
    });
  }

  finish(text) {
    this.footer.textContent = text;
  }
}
