// The operator page's script (docs/design/operations.md "The operator page"). No build step,
// no library: the state arrives as server-sent events from /api/events, every control is one
// POST /api/command carrying the session's CSRF token, and every value is put in the page as
// text (never as HTML).
"use strict";

const csrf = document.querySelector('meta[name="csrf-token"]').content;
const CLASSES = [
  "Active", "WaitingUser", "LongTool", "Parked", "Suspect", "HardResumeEligible",
  "NeedsFinalization", "Fencing", "Resuming", "StalledOperatorRequired",
];
const ENDED = ["done", "failed", "aborted"];
let selected = null;
let lastTasks = new Map();

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

function say(text, refused = false) {
  const message = document.getElementById("message");
  message.textContent = text;
  message.className = refused ? "message refused" : "message";
}

async function command(body) {
  const response = await fetch("/api/command", {
    method: "POST",
    headers: { "content-type": "application/json", "x-csrf-token": csrf },
    body: JSON.stringify(body),
    credentials: "same-origin",
  });
  const answer = await response.json();
  const what = `${body.command} ${body.task_id ?? body.delivery_id ?? ""}`.trim();
  if (answer.ok) say(`${what}: done`);
  else say(`${what}: ${answer.code}: ${answer.message}`, true);
  return answer;
}

function reason() {
  return document.getElementById("reason").value.trim() || "from the operator page";
}

function controls(task) {
  if (task.ended) return "";
  const cell = el("td");
  const id = task.task_id;
  const act = (name, extra) => el("button", {
    type: "button", "data-action": name, "data-task": id,
    onclick: () => command({ command: `task_${name}`, task_id: id, ...extra() }),
  }, name);
  cell.append(
    act("resume", () => ({ reason: reason() })),
    act("grant", () => ({ reason: reason(), epochs: 1, seconds: 600 })),
    act("reply", () => ({ text: reason() })),
    act("abort", () => ({ reason: reason() })),
    act("fail", () => ({ reason: reason() })),
  );
  return cell;
}

function silenceBar(task) {
  // OP11: a silence the watchdog does not measure (no prompt being worked on: a wait, a
  // settled or ended task, a failed lane) is said so, with no bar; a measured one is drawn
  // against its real threshold: the hard one of its phase, else the soft one
  const soft = task.soft_seconds.toFixed(1);
  const hardText = task.hard_seconds === null ? "—" : `${task.hard_seconds.toFixed(1)}`;
  if (!task.silence_watched) {
    return el("td", { class: "silence unwatched", title: "the watchdog measures no silence now" },
      `not watched (${soft} · ${hardText})`);
  }
  const silence = task.silence_seconds;
  const threshold = task.hard_seconds ?? task.soft_seconds;
  const scale = Math.max(threshold, silence);
  const bar = el("span", { class: "bar", title: `${silence.toFixed(1)} s of ${threshold.toFixed(1)} s` });
  if (silence >= task.soft_seconds) bar.classList.add("over-soft");
  if (task.hard_seconds !== null && silence >= task.hard_seconds) bar.classList.add("over-hard");
  const fill = el("span");
  fill.style.width = `${scale > 0 ? Math.min(100, (100 * silence) / scale) : 0}%`;
  bar.append(fill);
  return el("td", { class: "silence" }, bar, ` ${silence.toFixed(1)} s (${soft} · ${hardText})`);
}

function renderTasks(tasks) {
  const body = document.querySelector("#tasks tbody");
  body.replaceChildren(...tasks.map((task) => {
    const budget = task.budget;
    const row = el("tr", { "data-task": task.task_id },
      el("td", {}, el("a", { href: "#", onclick: (e) => { e.preventDefault(); showTask(task.task_id); } }, task.task_id)),
      el("td", { class: "state" }, task.ended ?? task.state),
      el("td", { class: `classification class-${task.classification}` }, task.classification),
      silenceBar(task),
      el("td", {}, `${budget.epochs_left} epochs · ${Math.round(budget.seconds_left)} s`),
      el("td", { class: "hold" }, task.hold_reason ?? ""),
      el("td", { class: "next" }, task.next_action),
      controls(task) || el("td"),
    );
    return row;
  }));
}

function render(state) {
  document.getElementById("server").textContent =
    `${state.worker_id} · ${state.admitting ? "admitting" : "NOT admitting"} · ` +
    `${state.connections} connections · ${state.unacknowledged} results unacknowledged`;
  const warning = document.getElementById("warning");
  warning.hidden = !state.warning;
  warning.textContent = state.warning ? `!!! ${state.warning} !!!` : "";
  document.getElementById("rooms-total").textContent = `(${state.rooms_total})`;
  document.querySelector("#rooms tbody").replaceChildren(...state.rooms.map((room) => el("tr", {},
    el("td", {}, room.room), el("td", {}, room.state), el("td", {}, room.queued),
    el("td", {}, room.live_worker ? "live" : "—"),
    el("td", { class: "last" }, room.last_result_seq
      ? `#${room.last_result_seq} ${room.last_outcome ?? ""}${room.last_code ? ` (${room.last_code})` : ""}`
      : "—"),
  )));
  document.getElementById("pending-total").textContent = `(${state.pending_total})`;
  document.querySelector("#pending tbody").replaceChildren(...state.pending.map((id) => el("tr", {},
    el("td", {}, el("a", { href: "#", onclick: (e) => { e.preventDefault(); showJournal(id); } }, id)),
    el("td", {}, el("button", { type: "button", onclick: () => command({ command: "cancel", delivery_id: id }) }, "cancel")),
  )));
  document.getElementById("tasks-total").textContent = state.tasks.length < state.tasks_total
    ? `(${state.tasks.length} of ${state.tasks_total}: the live ones first)`
    : `(${state.tasks_total})`;
  renderTasks(state.tasks);
  const now = new Map(state.tasks.map((t) => [t.task_id, JSON.stringify([t.classification, t.state, t.ended])]));
  if (selected !== null && now.get(selected) !== lastTasks.get(selected)) showTask(selected);
  lastTasks = now;
}

async function showTask(taskId) {
  selected = taskId;
  const response = await fetch(`/api/tasks/${encodeURIComponent(taskId)}`, { credentials: "same-origin" });
  const answer = await response.json();
  if (!response.ok) { say(`${taskId}: ${answer.code}: ${answer.message}`, true); return; }
  document.getElementById("task-detail").hidden = false;
  document.getElementById("detail-id").textContent = taskId;
  document.getElementById("detail").textContent = JSON.stringify(answer.task, null, 2);
  drawTimeline(answer.timeline, answer.task);
}

function drawTimeline(timeline, task) {
  const svg = document.getElementById("timeline");
  const NS = "http://www.w3.org/2000/svg";
  const node = (tag, attrs, text) => {
    const n = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
    if (text !== undefined) n.textContent = text;
    return n;
  };
  svg.replaceChildren();
  const levels = [...CLASSES];
  const width = 720, height = 150, left = 160, top = 8, bottom = 20;
  const row = (height - top - bottom) / (levels.length - 1);
  levels.forEach((name, i) => {
    const y = top + i * row;
    svg.append(node("text", { x: left - 6, y: y + 3, "text-anchor": "end", "font-size": 9 }, name));
    svg.append(node("line", { x1: left, x2: width - 4, y1: y, y2: y, stroke: "#eee" }));
  });
  if (!timeline.length) return;
  const start = timeline[0].at_ms;
  const end = Math.max(Date.now(), timeline[timeline.length - 1].at_ms + 1);
  const x = (t) => left + ((width - left - 8) * (t - start)) / (end - start);
  const y = (c) => top + Math.max(0, levels.indexOf(c)) * row;
  let d = "";
  timeline.forEach((p, i) => {
    d += i === 0 ? `M${x(p.at_ms)},${y(p.classification)}` : `H${x(p.at_ms)}V${y(p.classification)}`;
  });
  const last = timeline[timeline.length - 1];
  if (!ENDED.includes(last.state)) d += `H${x(end)}`;
  svg.append(node("path", { d, fill: "none", stroke: "#1c7ed6", "stroke-width": 2 }));
  for (const p of timeline) {
    const dot = node("circle", { cx: x(p.at_ms), cy: y(p.classification), r: 3, fill: "#1c7ed6" });
    dot.append(node("title", {}, `${new Date(p.at_ms).toISOString()} ${p.classification} (${p.state})`));
    svg.append(dot);
  }
  svg.append(node("text", { x: left, y: height - 4, "font-size": 9 }, new Date(start).toISOString().slice(11, 19)));
  svg.append(node("text", { x: width - 8, y: height - 4, "font-size": 9, "text-anchor": "end" },
    ENDED.includes(last.state) ? `${last.state} ${new Date(last.at_ms).toISOString().slice(11, 19)}` : "now"));
}

async function showJournal(deliveryId) {
  document.getElementById("journal-id").value = deliveryId;
  const response = await fetch(`/api/journal/${encodeURIComponent(deliveryId)}`, { credentials: "same-origin" });
  const answer = await response.json();
  const note = document.getElementById("journal-note");
  const out = document.getElementById("journal");
  if (!response.ok) {
    note.textContent = `${answer.code}: ${answer.message}`;
    out.textContent = "";
    return;
  }
  note.textContent = answer.note ?? `${answer.records.length} records`;
  out.textContent = answer.records.map((r) => JSON.stringify(r)).join("\n");
}

function connect() {
  const live = document.getElementById("live");
  const events = new EventSource("/api/events");
  events.addEventListener("open", () => { live.textContent = "live"; live.className = "badge on"; });
  events.addEventListener("error", () => { live.textContent = "reconnecting"; live.className = "badge off"; });
  events.addEventListener("state", (event) => render(JSON.parse(event.data)));
  events.addEventListener("logout", (event) => {
    // login_required: the session is gone, the login form says what to do; any other code
    // (token_insecure, token_invalid: the token file cannot be used) is said here, as the
    // login form cannot be shown until the operator has replaced the token
    events.close();
    const why = JSON.parse(event.data || "{}");
    if (!why.code || why.code === "login_required") {
      window.location.assign("/");
      return;
    }
    live.textContent = "logged out";
    live.className = "badge off";
    say(`logged out: ${why.code}: ${why.message}`, true);
  });
}

document.getElementById("journal-form").addEventListener("submit", (event) => {
  event.preventDefault();
  showJournal(document.getElementById("journal-id").value.trim());
});
document.getElementById("logout").addEventListener("click", async () => {
  await fetch("/logout", { method: "POST", headers: { "x-csrf-token": csrf }, credentials: "same-origin" });
  window.location.assign("/");
});
connect();
