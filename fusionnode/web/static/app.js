// FusionNode dashboard: follows /api/events (server-sent status) and draws it. Plain JS, no libraries.
// Actions (pause/resume this node, cancel a job) appear only when the page holds a token the server accepts.
"use strict";
(function () {
  const UTIL_WINDOW = 20;               // steps averaged in the utilisation bars
  const MAX_HISTORY = 5000;             // points kept per job in the page
  const PALETTE = ["#4fb3ff", "#3ecf8e", "#f5a524", "#c77dff", "#ff6b6b", "#2dd4bf", "#f472b6", "#a3e635"];
  const EVENT_COLORS = { join: "#3ecf8e", leave: "#f5a524", failure: "#ff6b6b", replan: "#4fb3ff", recovered: "#c77dff", resume: "#2dd4bf" };
  const SVG_NS = "http://www.w3.org/2000/svg";
  const histories = {};                 // job id -> step records, merged from the stream
  let updates = 0, token = null, allowed = [], last = null;

  const $ = (id) => document.getElementById(id);
  function el(tag, attrs, text) {
    const e = tag.startsWith("svg:") ? document.createElementNS(SVG_NS, tag.slice(4)) : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k !== "style") { e.setAttribute(k, v); continue; }
      // through the CSSOM: the page's Content-Security-Policy forbids inline style attributes
      for (const decl of String(v).split(";")) {
        const i = decl.indexOf(":");
        if (i > 0) e.style.setProperty(decl.slice(0, i).trim(), decl.slice(i + 1).trim());
      }
    }
    if (text !== undefined) e.textContent = text;
    return e;
  }
  const shortId = (id) => (id && id.length > 12 ? "…" + id.slice(-8) : String(id || "?"));
  const fmt = (x, d) => (x === null || x === undefined || !isFinite(x) ? "–" : Number(x).toFixed(d));
  function fmtBps(bps) {
    if (!isFinite(bps) || bps <= 0) return "?";
    if (bps >= 1e9) return (bps / 1e9).toFixed(bps >= 1e10 ? 0 : 1) + " Gb/s";
    if (bps >= 1e6) return (bps / 1e6).toFixed(bps >= 1e8 ? 0 : 1) + " Mb/s";
    return (bps / 1e3).toFixed(0) + " kb/s";
  }
  function fmtBytes(b) {
    if (!b) return "–";
    if (b >= 2 ** 30) return (b / 2 ** 30).toFixed(1) + " GiB";
    if (b >= 2 ** 20) return (b / 2 ** 20).toFixed(1) + " MiB";
    return (b / 1024).toFixed(0) + " KiB";
  }
  const relayed = (p) => (p.maddrs || []).length > 0 && (p.maddrs || []).every((m) => String(m).includes("/p2p-circuit"));
  const pathOf = (p) => (!p || !(p.maddrs || []).length ? "unknown" : relayed(p) ? "relayed" : "direct");

  // ---- the stream ----------------------------------------------------------------------------
  function merge(status) {
    for (const j of status.jobs || []) {
      const h = Array.isArray(j.history) ? j.history : [];
      if (!j.history_append || !histories[j.job]) histories[j.job] = h.slice();
      else if (h.length) {
        const first = h[0].step, old = histories[j.job];
        while (old.length && old[old.length - 1].step >= first) old.pop();
        old.push(...h);
        if (old.length > MAX_HISTORY) old.splice(0, old.length - MAX_HISTORY);
      }
      j.history = histories[j.job];
    }
    return status;
  }

  // stage rows of a job's plan, and the links between consecutive stages of a pipeline
  function pipeLinks(job) {
    const at = {};
    for (const s of job.stages || []) at[(s.replica || 0) + ":" + (s.pos ?? s.stage)] = s;
    const lastRec = (job.history || []).slice(-1)[0];
    const counters = {};
    for (const r of (lastRec && lastRec.stages) || []) counters[r.stage] = r.links || {};
    const out = [];
    for (const s of job.stages || []) {
      const pos = s.pos ?? s.stage, rep = s.replica || 0;
      for (const [dir, other] of [["fwd", pos + 1], ["bwd", pos - 1]]) {
        const t = at[rep + ":" + other];
        if (!t) continue;
        const c = (counters[s.stage] || {})[dir] || {};
        out.push({ job: job.job, stage: s.stage, dir, src: s.peer, dst: t.peer, dense: c.dense_bytes || 0, wire: c.wire_bytes || 0,
                   ratio: c.ratio, bps: c.bandwidth_bps });
      }
    }
    return out;
  }

  const isLive = (j) => j.state === "running" || j.state === "planning";  // its stages are in use

  function stageMap(jobs) {
    const m = {};
    for (const j of jobs) for (const s of j.stages || []) (m[s.peer] = m[s.peer] || []).push({ job: j.job, stage: s.stage });
    return m;
  }

  // ---- swarm map -----------------------------------------------------------------------------
  function drawSwarm(status) {
    const svg = $("swarm");
    svg.replaceChildren();
    const defs = el("svg:defs");
    const marker = el("svg:marker", { id: "arrow", viewBox: "0 0 10 10", refX: "9", refY: "5", markerWidth: "5", markerHeight: "5", orient: "auto-start-reverse" });
    marker.appendChild(el("svg:path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#aab6c3" }));
    defs.appendChild(marker);
    svg.appendChild(defs);
    const peers = (status.peers || []).slice().sort((a, b) => String(a.peer_id).localeCompare(String(b.peer_id)));
    if (!peers.some((p) => p.peer_id === status.peer_id) && status.peer_id)
      peers.unshift({ peer_id: status.peer_id, device: status.device || {}, roles: status.roles || [], links: {}, maddrs: status.maddrs });
    $("peer-count").textContent = "(" + peers.length + " peer" + (peers.length === 1 ? "" : "s") + ")";
    const W = 520, H = 420, cx = W / 2, cy = H / 2 + 4, R = peers.length > 1 ? 138 : 0;
    const pos = {}, byId = {};
    peers.forEach((p, i) => {
      const a = -Math.PI / 2 + (2 * Math.PI * i) / peers.length;
      pos[p.peer_id] = [cx + R * Math.cos(a), cy + R * Math.sin(a)];
      byId[p.peer_id] = p;
    });
    // measured links: one edge per pair, labelled with the mean of the measured directions
    const pairs = {};
    for (const p of peers) for (const [dst, l] of Object.entries(p.links || {})) {
      if (!(dst in pos) || dst === p.peer_id || !l || !isFinite(l.bandwidth_bps)) continue;
      const key = [p.peer_id, dst].sort().join("|");
      (pairs[key] = pairs[key] || []).push({ src: p.peer_id, dst, bps: l.bandwidth_bps, rtt: l.rtt_s });
    }
    const edges = el("svg:g", { class: "edges" }), labels = el("svg:g", { class: "edge-labels" });
    for (const [key, ms] of Object.entries(pairs)) {
      const [a, b] = key.split("|");
      const [x1, y1] = pos[a], [x2, y2] = pos[b];
      const bps = ms.reduce((s, m) => s + m.bps, 0) / ms.length;
      const w = Math.max(1, Math.min(6, Math.log10(Math.max(bps, 1e6) / 1e6) * 1.7 + 1));
      const path = relayed(byId[a]) || relayed(byId[b]) ? "relayed" : "direct";
      const line = el("svg:line", { class: "edge", x1, y1, x2, y2, "stroke-width": w.toFixed(1), "data-link": key, "data-bps": Math.round(bps), "data-path": path });
      line.appendChild(el("svg:title", {}, ms.map((m) => shortId(m.src) + " → " + shortId(m.dst) + ": " + fmtBps(m.bps) +
        (isFinite(m.rtt) ? ", rtt " + (m.rtt * 1000).toFixed(1) + " ms" : "")).join("\n") + "\n" + path));
      edges.appendChild(line);
      // at 38 % of the way from the first peer of the pair: crossing diagonals keep their labels apart
      labels.appendChild(el("svg:text", { class: "edge-label", x: x1 + 0.38 * (x2 - x1), y: y1 + 0.38 * (y2 - y1) + 3, "text-anchor": "middle" }, fmtBps(bps)));
    }
    svg.append(edges, labels);
    // the jobs' pipeline links, forward direction: dense (solid) or compressed (dashed, keep ratio)
    const pipes = el("svg:g", { class: "pipes" });
    let nPipes = 0, nCompressed = 0;
    const live = (status.jobs || []).filter(isLive);
    for (const j of live) for (const l of pipeLinks(j)) {
      if (l.dir !== "fwd" || !(l.src in pos) || !(l.dst in pos) || l.src === l.dst) continue;
      const [x1, y1] = pos[l.src], [x2, y2] = pos[l.dst];
      const dx = x2 - x1, dy = y2 - y1, d = Math.hypot(dx, dy) || 1, nx = -dy / d * 9, ny = dx / d * 9;
      const compressed = isFinite(l.ratio) && l.ratio < 1;
      const cls = compressed ? "compressed" : "dense";
      nPipes++; if (compressed) nCompressed++;
      const line = el("svg:line", { class: "pipe " + cls, x1: x1 + nx + dx * 0.14, y1: y1 + ny + dy * 0.14, x2: x2 + nx - dx * 0.14, y2: y2 + ny - dy * 0.14,
        "data-stage": l.stage, "data-compressed": String(compressed) });
      line.appendChild(el("svg:title", {}, "stage " + l.stage + " → " + (l.stage + 1) + ": " + (compressed ? "top-k keep " + fmt(l.ratio, 3) : "dense") +
        ", " + fmtBytes(l.dense) + " → " + fmtBytes(l.wire) + ", " + pathOf(byId[l.dst])));
      pipes.appendChild(line);
      pipes.appendChild(el("svg:text", { class: "pipe-label " + cls, x: x1 + dx * 0.62 + nx * 2, y: y1 + dy * 0.62 + ny * 2 + 3, "text-anchor": "middle" },
        compressed ? "top-k " + fmt(l.ratio, 2) : "dense"));
    }
    svg.appendChild(pipes);
    const stages = stageMap(live);
    const legend = $("legend");
    legend.replaceChildren();
    const seen = new Set();
    for (const p of peers) {
      const [x, y] = pos[p.peer_id];
      const st = stages[p.peer_id] || [];
      const color = st.length ? PALETTE[st[0].stage % PALETTE.length] : "#56616d";
      const g = el("svg:g", { class: "peer", "data-peer-id": p.peer_id, "data-stages": st.map((s) => s.stage).join(","), "data-path": pathOf(p) });
      const tflops = (p.device && p.device.tflops_fp32) || 0;
      const r = 16 + Math.min(14, Math.sqrt(Math.max(tflops, 0)) * 4);
      g.appendChild(el("svg:circle", { cx: x, cy: y, r: r.toFixed(1), fill: p.availability === "paused" ? "#56616d" : color, class: p.peer_id === status.peer_id ? "node-self" : "node" }));
      if (st.length) g.appendChild(el("svg:text", { x, y: y + 4, "text-anchor": "middle", "font-weight": "700", fill: "#0f1419" }, "S" + st.map((s) => s.stage).join("/")));
      const below = y >= cy;
      g.appendChild(el("svg:text", { x, y: below ? y + r + 14 : y - r - 18, "text-anchor": "middle", class: "mono" }, shortId(p.peer_id) + (p.peer_id === status.peer_id ? " (this)" : "")));
      g.appendChild(el("svg:text", { x, y: below ? y + r + 27 : y - r - 5, "text-anchor": "middle", class: "tick" },
        ((p.device && p.device.kind) || "?") + " · " + fmt(tflops, 2) + " TF" + (p.availability && p.availability !== "available" ? " · " + p.availability : "")));
      g.appendChild(el("svg:title", {}, p.peer_id + "\n" + ((p.device && p.device.name) || "") + "\nroles: " + (p.roles || []).join(",") + "\npath: " + pathOf(p)));
      svg.appendChild(g);
      for (const s of st) if (!seen.has(s.stage)) {
        seen.add(s.stage);
        legend.appendChild(el("span", { style: "--c:" + PALETTE[s.stage % PALETTE.length] }, "stage " + s.stage));
      }
    }
    if (!seen.size) legend.appendChild(el("span", { style: "--c:#56616d" }, "no stage assigned"));
    if (nPipes) legend.append(el("span", { style: "--c:#4fb3ff" }, "dense link"), el("span", { style: "--c:#f5a524" }, "compressed link"));
    svg.setAttribute("data-peers", String(peers.length));
    svg.setAttribute("data-links", String(Object.keys(pairs).length));
    svg.setAttribute("data-pipes", String(nPipes));
    svg.setAttribute("data-compressed", String(nCompressed));
  }

  // ---- charts --------------------------------------------------------------------------------
  function drawChart(svg, series, key, digits, dots) {
    svg.replaceChildren();
    const W = 520, H = Number(svg.getAttribute("viewBox").split(" ")[3]), L = 48, Rm = 10, T = 10, B = 24;
    const all = series.flatMap((s) => s.points.filter((p) => isFinite(p[key])));
    const extra = (dots || []).flatMap((s) => s.points.filter((p) => isFinite(p.loss)).map((p) => ({ step: p.step, [key]: p.loss })));
    svg.setAttribute("data-points", String(all.length));
    if (!all.length && !extra.length) {
      svg.appendChild(el("svg:text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "tick" }, "waiting for steps…"));
      return;
    }
    const pts = all.concat(extra);
    let x0 = Math.min(...pts.map((p) => p.step)), x1 = Math.max(...pts.map((p) => p.step));
    let y0 = Math.min(...pts.map((p) => p[key])), y1 = Math.max(...pts.map((p) => p[key]));
    if (x1 === x0) x1 = x0 + 1;
    if (y1 === y0) { y0 -= 0.5 * Math.abs(y0 || 1); y1 += 0.5 * Math.abs(y1 || 1); }
    const pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
    const sx = (s) => L + ((s - x0) / (x1 - x0)) * (W - L - Rm);
    const sy = (v) => T + (1 - (v - y0) / (y1 - y0)) * (H - T - B);
    for (let i = 0; i <= 4; i++) {
      const v = y0 + ((y1 - y0) * i) / 4, y = sy(v);
      svg.appendChild(el("svg:line", { class: "axis", x1: L, x2: W - Rm, y1: y, y2: y }));
      svg.appendChild(el("svg:text", { class: "tick", x: L - 6, y: y + 3, "text-anchor": "end" }, fmt(v, digits)));
    }
    svg.appendChild(el("svg:text", { class: "tick", x: L, y: H - 6 }, "step " + x0));
    svg.appendChild(el("svg:text", { class: "tick", x: W - Rm, y: H - 6, "text-anchor": "end" }, "step " + x1));
    series.forEach((s, i) => {
      const p = s.points.filter((q) => isFinite(q[key])).map((q) => sx(q.step).toFixed(1) + "," + sy(q[key]).toFixed(1));
      svg.appendChild(el("svg:polyline", { class: "line", points: p.join(" "), stroke: PALETTE[i % PALETTE.length], "data-job": s.job, "data-points": String(p.length) }));
    });
    for (const s of dots || []) for (const p of s.points) if (isFinite(p.loss)) {
      const c = el("svg:circle", { class: "val", cx: sx(p.step), cy: sy(p.loss), r: 4.5, "data-job": s.job });
      c.appendChild(el("svg:title", {}, "validation loss " + fmt(p.loss, 4) + " at step " + p.step));
      svg.appendChild(c);
    }
  }

  // ---- plan picture: one row per device, one column per pipeline position ----------------------
  function drawPlan(jobs) {
    const box = $("plan");
    box.replaceChildren();
    let n = 0;
    for (const j of jobs) {
      const stages = j.stages || [];
      if (!stages.length) continue;
      n++;
      const devices = [...new Set(stages.map((s) => s.peer))].sort();
      const cols = [...new Set(stages.map((s) => (s.replica || 0) + ":" + (s.pos ?? s.stage)))].sort((a, b) => {
        const [ra, pa] = a.split(":").map(Number), [rb, pb] = b.split(":").map(Number);
        return ra - rb || pa - pb;
      });
      const L = 92, T = 20, cw = Math.min(110, (520 - L) / cols.length), ch = 28, H = T + ch * devices.length + 6;
      const svg = el("svg:svg", { viewBox: "0 0 520 " + H, class: "plan", "data-job": j.job, "data-devices": devices.length, "data-columns": cols.length });
      cols.forEach((c, i) => {
        const [rep, pos] = c.split(":");
        svg.appendChild(el("svg:text", { class: "tick", x: L + cw * i + cw / 2, y: 12, "text-anchor": "middle" }, (cols.some((x) => x.split(":")[0] !== "0") ? "R" + rep + " " : "") + "pos " + pos));
      });
      devices.forEach((d, r) => {
        svg.appendChild(el("svg:text", { class: "mono tick", x: L - 6, y: T + ch * r + ch / 2 + 4, "text-anchor": "end" }, shortId(d)));
        cols.forEach((c, i) => {
          const s = stages.find((q) => q.peer === d && (q.replica || 0) + ":" + (q.pos ?? q.stage) === c);
          const x = L + cw * i, y = T + ch * r;
          if (!s) { svg.appendChild(el("svg:rect", { class: "cell-empty", x, y, width: cw, height: ch })); return; }
          const rect = el("svg:rect", { class: "cell", x, y, width: cw, height: ch, fill: PALETTE[s.stage % PALETTE.length], "data-stage": s.stage });
          rect.appendChild(el("svg:title", {}, "stage " + s.stage + " on " + d + ": OP-DAG nodes [" + s.lo + ", " + s.hi + "), " + s.n_params + " parameter tensors"));
          svg.append(rect, el("svg:text", { class: "cell-text", x: x + cw / 2, y: y + ch / 2 + 4, "text-anchor": "middle" }, "S" + s.stage + " [" + s.lo + "," + s.hi + ")"));
        });
      });
      if (jobs.length > 1) box.appendChild(el("div", { class: "muted mono" }, j.job));
      box.appendChild(svg);
    }
    $("plan-empty").classList.toggle("hidden", n > 0);
  }

  function drawUtil(jobs) {
    const box = $("util");
    box.replaceChildren();
    let rows = 0;
    for (const j of jobs) {
      const hist = (j.history || []).filter((r) => Array.isArray(r.stages) && r.step_time_s > 0).slice(-UTIL_WINDOW);
      if (!hist.length) continue;
      const acc = {};
      for (const r of hist) for (const s of r.stages) {
        const a = (acc[s.stage] = acc[s.stage] || { c: 0, w: 0, n: 0 });
        a.c += (s.compute_s || 0) / r.step_time_s; a.w += (s.wait_s || 0) / r.step_time_s; a.n += 1;
      }
      const peerOf = Object.fromEntries((j.stages || []).map((s) => [s.stage, s.peer]));
      for (const st of Object.keys(acc).sort((a, b) => a - b)) {
        const a = acc[st], c = Math.min(1, a.c / a.n), w = Math.min(1 - c, a.w / a.n);
        const row = el("div", { class: "bar-row", "data-stage": st, "data-util": c.toFixed(3), "data-bubble": w.toFixed(3) });
        row.appendChild(el("span", { class: "mono", title: peerOf[st] || "" }, (jobs.length > 1 ? j.job + " " : "") + "S" + st + " " + shortId(peerOf[st] || "")));
        const bar = el("div", { class: "bar" });
        bar.appendChild(el("div", { class: "compute", style: "width:" + (c * 100).toFixed(1) + "%", title: "compute" }));
        bar.appendChild(el("div", { class: "wait", style: "width:" + (w * 100).toFixed(1) + "%", title: "bubble: waiting for neighbours" }));
        bar.appendChild(el("div", { class: "other", style: "width:" + ((1 - c - w) * 100).toFixed(1) + "%", title: "sending, optimizer, other" }));
        row.append(bar, el("span", {}, (c * 100).toFixed(0) + "% · " + (w * 100).toFixed(0) + "%"));
        box.appendChild(row);
        rows++;
      }
    }
    $("util-empty").classList.toggle("hidden", rows > 0);
    if (rows) box.appendChild(el("div", { class: "legend" }, "")).append(
      el("span", { style: "--c:#3ecf8e" }, "compute (utilisation)"), el("span", { style: "--c:#d6a94a" }, "bubble (waiting)"), el("span", { style: "--c:#3b4856" }, "other"));
  }

  function drawLinks(jobs) {
    const tb = $("links").tBodies[0];
    tb.replaceChildren();
    let n = 0;
    for (const j of jobs) for (const l of pipeLinks(j)) {
      if (!l.dense) continue;
      n++;
      const tr = el("tr", { "data-job": j.job, "data-stage": l.stage, "data-dir": l.dir, "data-dense": l.dense, "data-wire": l.wire });
      [(jobs.length > 1 ? j.job + " " : "") + "S" + l.stage + " " + (l.dir === "fwd" ? "act →" : "← grad"), shortId(l.src) + " → " + shortId(l.dst),
       fmtBytes(l.dense), fmtBytes(l.wire), l.wire ? (l.dense / l.wire).toFixed(1) + "×" : "–", isFinite(l.ratio) ? fmt(l.ratio, 3) : "–"]
        .forEach((v, i) => tr.appendChild(el("td", { class: i < 2 ? "mono" : "" }, String(v))));
      tb.appendChild(tr);
    }
    $("links-empty").classList.toggle("hidden", n > 0);
  }

  function drawEvents(jobs) {
    const svg = $("timeline"), list = $("events");
    svg.replaceChildren(); list.replaceChildren();
    const W = 520, L = 10, R = 10, y = 40;
    const evs = jobs.flatMap((j) => (j.events || []).map((e) => ({ ...e, job: j.job, steps: j.steps })));
    const maxStep = Math.max(1, ...jobs.map((j) => j.steps || 0), ...evs.map((e) => e.step || 0));
    svg.appendChild(el("svg:line", { class: "axis", x1: L, x2: W - R, y1: y, y2: y }));
    svg.appendChild(el("svg:text", { class: "tick", x: L, y: y + 26 }, "step 0"));
    svg.appendChild(el("svg:text", { class: "tick", x: W - R, y: y + 26, "text-anchor": "end" }, "step " + maxStep));
    for (const j of jobs) {
      const x = L + ((j.step || 0) / maxStep) * (W - L - R);
      svg.appendChild(el("svg:line", { class: "axis", x1: L, x2: x, y1: y, y2: y, stroke: "#3ecf8e", "stroke-width": 4 }));
    }
    evs.forEach((e, i) => {
      const x = L + ((e.step || 0) / maxStep) * (W - L - R), c = EVENT_COLORS[e.event] || "#aab6c3";
      const m = el("svg:line", { class: "ev", x1: x, x2: x, y1: y - 14, y2: y + 8, stroke: c, "data-event": e.event });
      m.appendChild(el("svg:title", {}, e.event + " at step " + (e.step ?? "?") + (e.reason ? ": " + e.reason : "")));
      svg.appendChild(m);
      svg.appendChild(el("svg:text", { class: "ev-label", x: Math.max(L + 16, Math.min(W - R - 16, x)), y: y - 18 - (i % 3) * 10, "text-anchor": "middle" }, e.event));
    });
    svg.setAttribute("data-events", String(evs.length));
    for (const e of evs.slice().reverse().slice(0, 50)) {
      const li = el("li", {});
      li.append(el("span", { class: "kind k-" + e.event }, e.event), document.createTextNode(
        " step " + (e.step ?? 0) + (e.peer ? " · " + shortId(e.peer) : "") + (e.reason ? " · " + e.reason : "") +
        (e.ts ? " · " + new Date(e.ts * 1000).toLocaleTimeString() : "")));
      list.appendChild(li);
    }
  }

  function drawTables(status, jobs) {
    const tb = $("jobs").tBodies[0];
    // rows are updated in place, by job (the page redraws once a second while a job runs): a click on
    // a Cancel button whose press and release straddle a redraw never fires if its row was replaced
    const rows = new Map([...tb.rows].map((tr) => [tr.dataset.job, tr]));
    jobs.forEach((j, k) => {
      const tr = rows.get(j.job) || el("tr", { "data-job": j.job });
      rows.delete(j.job);
      tr.dataset.state = j.state;
      const lastRec = (j.history || []).slice(-1)[0];
      const val = (j.validation || []).slice(-1)[0];
      const cells = [j.job, j.model, j.state, j.step + " / " + j.steps, fmt(j.loss, 4), val ? fmt(val.loss, 4) + " @" + val.step : "–", fmt(j.tokens_per_s, 0),
       lastRec ? fmt(lastRec.step_time_s, 3) + " s" : "–",
       "v" + j.plan_version + " · " + (j.stages || []).length + " stages" + (lastRec && lastRec.wire_bytes ? " · " + fmtBytes(lastRec.wire_bytes) + "/step" : "")];
      while (tr.cells.length < cells.length + 1) tr.appendChild(el("td", {}));
      cells.forEach((v, i) => {
        const td = tr.cells[i];
        td.className = i === 0 ? "mono" : "";
        if (td.textContent !== String(v)) td.textContent = String(v);
      });
      const td = tr.cells[cells.length];
      td.className = "act";
      let b = td.querySelector("button.cancel");
      if (allowed.includes("cancel") && (j.state === "running" || j.state === "planning")) {
        if (!b) {
          b = el("button", { type: "button", class: "danger cancel", "data-job": j.job }, "Cancel");
          const mine = b;
          b.addEventListener("click", () => act("cancel", { job: j.job }, mine));
          td.appendChild(b);
        }
      } else if (b) {
        b.remove();
      }
      if (tb.rows[k] !== tr) tb.insertBefore(tr, tb.rows[k] || null);
    });
    for (const tr of rows.values()) tr.remove();
    $("jobs-empty").classList.toggle("hidden", jobs.length > 0);
    const pb = $("peers").tBodies[0];
    pb.replaceChildren();
    for (const p of status.peers || []) {
      const d = p.device || {};
      const tr = el("tr", { "data-peer-id": p.peer_id });
      [shortId(p.peer_id) + (p.peer_id === status.peer_id ? " *" : ""), (d.kind || "?") + " " + (d.name || ""),
       fmt(d.tflops_fp32, 2), fmtBytes(d.memory_total_bytes), (p.roles || []).join(","), pathOf(p), p.availability || "?"]
        .forEach((v, i) => tr.appendChild(el("td", { class: i === 0 ? "mono" : "", title: i === 0 ? p.peer_id : "" }, String(v))));
      pb.appendChild(tr);
    }
    const sv = $("serving");
    sv.replaceChildren();
    for (const s of status.serving || [])
      sv.appendChild(el("li", {}, "job " + s.job + " stage " + s.stage + (s.num_stages ? "/" + s.num_stages : "") + (s.last_step !== undefined ? " · last step " + s.last_step : "")));
    $("serving-title").classList.toggle("hidden", !(status.serving || []).length);
  }

  function render(status) {
    last = status;
    const jobs = status.jobs || [];
    const dev = status.device || {};
    $("self").textContent = (status.peer_id || "?") + " · " + (dev.kind || "?") + " " + (dev.name || "") +
      " · roles " + (status.roles || []).join(",") + " · up " + fmt(status.uptime_s, 0) + " s";
    const av = (status.availability && status.availability.availability) || status.availability || "?";
    $("availability").textContent = typeof av === "string" ? av : "?";
    $("availability").className = "pill " + (av === "available" ? "ok" : "bad");
    document.body.dataset.availability = typeof av === "string" ? av : "?";
    const reach = status.reachability || {};
    const names = { public: "reachable", relayed: "behind NAT · relayed", nat: "behind NAT", local: "local", unknown: "reach ?" };
    $("reach").textContent = names[reach.state] || "reach ?";
    $("reach").title = (reach.line || "") + ((reach.relayed_peers || []).length ? " · relayed links: " + reach.relayed_peers.map((p) => p.slice(-6)).join(", ") : "");
    $("reach").className = "pill " + (reach.state === "public" || reach.state === "local" || reach.state === "relayed" ? "ok" : "bad");
    document.body.dataset.reachability = reach.state || "unknown";
    drawSwarm(status);
    drawChart($("loss"), jobs.map((j) => ({ job: j.job, points: j.history || [] })), "loss", 3,
      jobs.map((j) => ({ job: j.job, points: j.validation || [] })));
    drawChart($("tput"), jobs.map((j) => ({ job: j.job, points: j.history || [] })), "tokens_per_s", 0);
    // the plan, stage and link panels follow the running jobs (else the latest one), not every past job
    const live = jobs.filter(isLive), focus = live.length ? live : jobs.slice(-1);
    drawPlan(focus);
    drawUtil(focus);
    drawLinks(focus);
    drawEvents(jobs);
    drawTables(status, jobs);
  }

  // ---- actions -------------------------------------------------------------------------------
  function toast(text, bad) {
    const t = $("toast");
    t.textContent = text;
    t.className = "toast" + (bad ? " bad" : "");
    t.dataset.result = bad ? "error" : "ok";
    clearTimeout(toast.timer);
    toast.timer = setTimeout(() => t.classList.add("hidden"), 6000);
  }

  async function act(name, body, button) {
    if (button) button.disabled = true;
    try {
      const r = await fetch("api/action/" + name, {
        method: "POST", cache: "no-store",
        headers: { "Authorization": "Bearer " + token, "Content-Type": "application/json" },
        body: JSON.stringify(body || {}),
      });
      const text = await r.text();
      let res = {};
      try { res = JSON.parse(text); } catch (e) { res = { error: text.trim() }; }
      if (!r.ok) throw new Error(res.error || "HTTP " + r.status);
      toast(name + ": " + JSON.stringify(res), false);
      document.body.dataset.lastAction = name;
    } catch (e) {
      toast(name + " failed: " + e.message, true);
    } finally {
      if (button) button.disabled = false;
    }
  }

  async function checkToken() {
    const m = /(?:^|[#&])token=([A-Za-z0-9_-]+)/.exec(location.hash);
    if (m) {
      sessionStorage.setItem("fusionnode-token", m[1]);
      history.replaceState(null, "", location.pathname + location.search);  // off the address bar
    }
    token = sessionStorage.getItem("fusionnode-token");
    if (!token) return;
    try {
      const r = await fetch("api/session", { cache: "no-store", headers: { "Authorization": "Bearer " + token } });
      if (!r.ok) throw new Error("HTTP " + r.status);
      allowed = (await r.json()).actions || [];
    } catch (e) {
      allowed = [];
      toast("the token was not accepted (" + e.message + "): read-only", true);
    }
    $("actions").classList.toggle("hidden", !allowed.length);
    for (const b of $("actions").querySelectorAll("button")) b.classList.toggle("hidden", !allowed.includes(b.dataset.action));
    document.body.dataset.actions = allowed.length ? "on" : "off";
    $("mode").textContent = allowed.length ? "actions: " + allowed.join(", ") : "read-only";
    if (last) render(last);
  }

  function connect() {
    const es = new EventSource("api/events");
    es.onmessage = (ev) => {
      try {
        render(merge(JSON.parse(ev.data)));
      } catch (e) {
        document.body.dataset.state = "error";
        $("conn").textContent = "bad update: " + e.message; $("conn").className = "pill bad";
        return;
      }
      updates++;
      document.body.dataset.updates = String(updates);
      document.body.dataset.state = "ok";
      $("conn").textContent = "live"; $("conn").className = "pill ok";
    };
    es.addEventListener("error", (ev) => {
      document.body.dataset.state = "error";
      let why = "reconnecting…";
      if (ev.data) try { why = JSON.parse(ev.data).error; } catch (e) { /* keep the generic text */ }
      $("conn").textContent = "offline: " + why; $("conn").className = "pill bad";
    });
  }

  for (const b of $("actions").querySelectorAll("button")) b.addEventListener("click", () => act(b.dataset.action, {}, b));
  window.addEventListener("hashchange", checkToken);  // a token pasted into an open page
  checkToken();
  connect();
})();
