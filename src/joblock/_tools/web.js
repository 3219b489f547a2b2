// joblock web: fetches a page of locks as JSON and draws it; again every few seconds.
// Everything from Redis is put in as text (textContent), never as HTML.
"use strict";

const refresh = 1000 * Number(document.querySelector('meta[name="joblock-refresh"]').content);
const csrf = document.querySelector('meta[name="joblock-csrf"]').content;
const state = { match: "", cursor: "", pages: [], next: null, seq: 0, timer: null };

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, props || {});
  for (const child of children) node.append(child);
  return node;
}

function say(text, error) {
  const message = document.getElementById("message");
  message.textContent = text;
  message.className = error ? "error" : "";
  message.hidden = !text;
}

function ttl(seconds) {
  return seconds === null ? "no ttl" : `${seconds.toFixed(1)} s`;
}

function kind(lock) {
  const n = lock.holders.length;
  if (lock.kind === "counting") return `[limit ${lock.limit}] ${n} of ${lock.limit} places`;
  if (lock.kind === "readers") return `[reader] ${n} reader${n === 1 ? "" : "s"}`;
  return "lock";
}

function waiters(lock) {
  if (!lock.waiters.length) return "-";
  return el("ol", { className: "waiters" }, ...lock.waiters.map(
    (w) => el("li", {}, `${w.holder} (${w.kind}, waits ${w.left.toFixed(1)} s more)`)));
}

function row(lock, holder, first, allowRelease) {
  const tr = el("tr", { className: "holder" });
  tr.dataset.key = lock.key;
  if (first) {
    const span = { rowSpan: lock.holders.length };
    tr.append(el("td", { className: "key", ...span }, lock.key));
    tr.append(el("td", { className: "kind", ...span }, kind(lock)));
  }
  tr.append(el("td", { className: "holder" }, holder.holder));
  tr.append(el("td", { className: "ttl" }, ttl(holder.ttl)));
  tr.append(el("td", { className: "fence" }, holder.fence === null ? "-" : String(holder.fence)));
  if (first) tr.append(el("td", { className: "waiting", rowSpan: lock.holders.length }, waiters(lock)));
  if (allowRelease) {
    const button = el("button", { type: "button", className: "release" }, "Release");
    button.addEventListener("click", () => release(lock, holder));
    tr.append(el("td", {}, button));
  }
  return tr;
}

function draw(data) {
  const jobs = document.getElementById("jobs");
  const sections = data.jobs.map((job) => {
    const head = ["Key", "Kind", "Holder", "Time left", "Fence", "Waiting"];
    if (data.release) head.push("");
    const rows = job.locks.flatMap((lock) => lock.holders.map((h, i) => row(lock, h, i === 0, data.release)));
    const title = el("a", { href: "#" }, job.job);
    title.addEventListener("click", (event) => { event.preventDefault(); filter(job.job); });
    const count = job.locks.length;
    return el("section", { className: "job" },
      el("h2", {}, title, el("span", { className: "muted" }, ` ${count} lock${count === 1 ? "" : "s"}`)),
      el("table", {}, el("thead", {}, el("tr", {}, ...head.map((h) => el("th", {}, h)))), el("tbody", {}, ...rows)));
  });
  jobs.replaceChildren(...sections);
  const page = state.pages.length + 1;
  const more = data.next ? "; more on the next page" : "; the scan is done";
  document.getElementById("status").textContent =
    `page ${page}: ${data.holders} holder${data.holders === 1 ? "" : "s"} among ${data.keys} keys ` +
    `matching ${data.prefix}:${data.match}${more} (updated ${new Date().toLocaleTimeString()})`;
  state.next = data.next;
  document.getElementById("next").disabled = !data.next;
  document.getElementById("first").disabled = !state.cursor;
}

async function load() {
  clearTimeout(state.timer);
  const seq = ++state.seq;
  const query = new URLSearchParams({ match: state.match, cursor: state.cursor });
  try {
    const response = await fetch(`/api/locks?${query}`, { headers: { Accept: "application/json" } });
    const data = await response.json();
    if (seq !== state.seq) return;  // a newer load started meanwhile
    if (!response.ok) throw new Error(data.error || response.statusText);
    draw(data);
    if (document.getElementById("message").className === "error") say("");
  } catch (error) {
    if (seq === state.seq) say(`Could not read the locks: ${error.message}`, true);
  } finally {
    if (seq === state.seq) state.timer = setTimeout(load, refresh);
  }
}

async function release(lock, holder) {
  if (!window.confirm(`Release ${lock.key}, held by ${holder.holder}? Its job keeps running without it.`)) return;
  try {
    const response = await fetch("/api/release", {
      method: "POST",
      headers: { "Content-Type": "application/json", "X-Joblock-CSRF": csrf },
      body: JSON.stringify({ key: lock.ref, id: holder.id }),
    });
    const data = await response.json();
    say(data.message || data.error, !response.ok);
  } catch (error) {
    say(`Could not release: ${error.message}`, true);
  }
  load();
}

function filter(text) {
  document.getElementById("filter").value = text;
  state.match = text;
  state.cursor = "";
  state.pages = [];
  load();
}

document.getElementById("filter-form").addEventListener("submit", (event) => {
  event.preventDefault();
  filter(document.getElementById("filter").value);
});
document.getElementById("clear").addEventListener("click", () => filter(""));
document.getElementById("next").addEventListener("click", () => {
  if (!state.next) return;
  state.pages.push(state.cursor);
  state.cursor = state.next;
  load();
});
document.getElementById("first").addEventListener("click", () => {
  state.cursor = "";
  state.pages = [];
  load();
});
load();
