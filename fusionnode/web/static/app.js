// FusionNode dashboard: polls /api/status and draws it. Plain JS, no libraries, read-only.
"use strict";
(function () {
  const POLL_MS = 1500;                 // between polls of /api/status
  const UTIL_WINDOW = 20;               // steps averaged in the utilisation bars
  const MAX_LOCAL_HISTORY = 500;        // points kept per job when the server sends no history
  const PALETTE = ["#4fb3ff", "#3ecf8e", "#f5a524", "#c77dff", "#ff6b6b", "#2dd4bf", "#f472b6", "#a3e635"];
  const SVG_NS = "http://www.w3.org/2000/svg";
  const localHistory = {};              // job id -> [{step, loss, tokens_per_s}], built from polls
  let polls = 0;

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
  const fmtBytes = (b) => (!b ? "–" : b >= 2 ** 30 ? (b / 2 ** 30).toFixed(1) + " GiB" : (b / 2 ** 20).toFixed(0) + " MiB");

  function historyOf(status, job) {
    if (Array.isArray(job.history) && job.history.length) return job.history;
    const h = status.history && status.history[job.job];
    if (Array.isArray(h) && h.length) return h;
    const loc = localHistory[job.job] || (localHistory[job.job] = []);
    if (job.step > 0 && job.loss !== null && (!loc.length || loc[loc.length - 1].step !== job.step - 1)) {
      loc.push({ step: job.step - 1, loss: job.loss, tokens_per_s: job.tokens_per_s });
      if (loc.length > MAX_LOCAL_HISTORY) loc.shift();
    }
    return loc;
  }

  // stage assignment: peer id -> [{job, stage}]
  function stageMap(jobs) {
    const m = {};
    for (const j of jobs) for (const s of j.stages || []) (m[s.peer] = m[s.peer] || []).push({ job: j.job, stage: s.stage });
    return m;
  }

  function drawSwarm(status) {
    const svg = $("swarm");
    svg.replaceChildren();
    const peers = (status.peers || []).slice().sort((a, b) => String(a.peer_id).localeCompare(String(b.peer_id)));
    if (!peers.some((p) => p.peer_id === status.peer_id) && status.peer_id)
      peers.unshift({ peer_id: status.peer_id, device: status.device || {}, roles: status.roles || [], links: {} });
    $("peer-count").textContent = "(" + peers.length + " peer" + (peers.length === 1 ? "" : "s") + ")";
    const W = 520, H = 420, cx = W / 2, cy = H / 2 + 4, R = peers.length > 1 ? 138 : 0;
    const pos = {};
    peers.forEach((p, i) => {
      const a = -Math.PI / 2 + (2 * Math.PI * i) / peers.length;
      pos[p.peer_id] = [cx + R * Math.cos(a), cy + R * Math.sin(a)];
    });
    // edges: one per measured pair; label = mean of the measured directions
    const pairs = {};
    for (const p of peers) for (const [dst, l] of Object.entries(p.links || {})) {
      if (!(dst in pos) || dst === p.peer_id || !l || !isFinite(l.bandwidth_bps)) continue;
      const key = [p.peer_id, dst].sort().join("|");
      (pairs[key] = pairs[key] || []).push({ src: p.peer_id, dst, bps: l.bandwidth_bps, rtt: l.rtt_s });
    }
    const edges = el("svg:g", { class: "edges" });
    const labels = el("svg:g", { class: "edge-labels" });
    for (const [key, ms] of Object.entries(pairs)) {
      const [a, b] = key.split("|");
      const [x1, y1] = pos[a], [x2, y2] = pos[b];
      const bps = ms.reduce((s, m) => s + m.bps, 0) / ms.length;
      const w = Math.max(1, Math.min(6, Math.log10(Math.max(bps, 1e6) / 1e6) * 1.7 + 1));
      const line = el("svg:line", { class: "edge", x1, y1, x2, y2, "stroke-width": w.toFixed(1), "data-link": key, "data-bps": Math.round(bps) });
      line.appendChild(el("svg:title", {}, ms.map((m) => shortId(m.src) + " → " + shortId(m.dst) + ": " + fmtBps(m.bps) +
        (isFinite(m.rtt) ? ", rtt " + (m.rtt * 1000).toFixed(1) + " ms" : "")).join("\n")));
      edges.appendChild(line);
            // at 38 % of the way from the first peer of the pair: crossing diagonals keep their labels apart
      labels.appendChild(el("svg:text", { class: "edge-label", x: x1 + 0.38 * (x2 - x1), y: y1 + 0.38 * (y2 - y1) + 3, "text-anchor": "middle" }, fmtBps(bps)));
    }
    svg.append(edges, labels);
    const stages = stageMap(status.jobs || []);
    const legend = $("legend");
    legend.replaceChildren();
    const seen = new Set();
    for (const p of peers) {
      const [x, y] = pos[p.peer_id];
      const st = stages[p.peer_id] || [];
      const color = st.length ? PALETTE[st[0].stage % PALETTE.length] : "#56616d";
      const g = el("svg:g", { class: "peer", "data-peer-id": p.peer_id, "data-stages": st.map((s) => s.stage).join(",") });
      const tflops = (p.device && p.device.tflops_fp32) || 0;
      const r = 16 + Math.min(14, Math.sqrt(Math.max(tflops, 0)) * 4);
      g.appendChild(el("svg:circle", { cx: x, cy: y, r: r.toFixed(1), fill: color, class: p.peer_id === status.peer_id ? "node-self" : "node" }));
      if (st.length) g.appendChild(el("svg:text", { x, y: y + 4, "text-anchor": "middle", "font-weight": "700", fill: "#0f1419" }, "S" + st.map((s) => s.stage).join("/")));
      const below = y >= cy;
      g.appendChild(el("svg:text", { x, y: below ? y + r + 14 : y - r - 18, "text-anchor": "middle", class: "mono" }, shortId(p.peer_id) + (p.peer_id === status.peer_id ? " (this)" : "")));
      g.appendChild(el("svg:text", { x, y: below ? y + r + 27 : y - r - 5, "text-anchor": "middle", class: "tick" },
        ((p.device && p.device.kind) || "?") + " · " + fmt(tflops, 2) + " TF"));
      g.appendChild(el("svg:title", {}, p.peer_id + "\n" + ((p.device && p.device.name) || "") + "\nroles: " + (p.roles || []).join(",")));
      svg.appendChild(g);
      for (const s of st) if (!seen.has(s.stage)) {
        seen.add(s.stage);
        legend.appendChild(el("span", { style: "--c:" + PALETTE[s.stage % PALETTE.length] }, "stage " + s.stage));
      }
    }
    if (!seen.size) legend.appendChild(el("span", { style: "--c:#56616d" }, "no stage assigned"));
    svg.setAttribute("data-peers", String(peers.length));
    svg.setAttribute("data-links", String(Object.keys(pairs).length));
  }

  function drawChart(svg, series, key, digits) {
    svg.replaceChildren();
    const W = 520, H = 200, L = 48, Rm = 10, T = 10, B = 24;
    const all = series.flatMap((s) => s.points.filter((p) => isFinite(p[key])));
    svg.setAttribute("data-points", String(all.length));
    if (!all.length) {
      svg.appendChild(el("svg:text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "tick" }, "waiting for steps…"));
      return;
    }
    let x0 = Math.min(...all.map((p) => p.step)), x1 = Math.max(...all.map((p) => p.step));
    let y0 = Math.min(...all.map((p) => p[key])), y1 = Math.max(...all.map((p) => p[key]));
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
      const pts = s.points.filter((p) => isFinite(p[key])).map((p) => sx(p.step).toFixed(1) + "," + sy(p[key]).toFixed(1));
      svg.appendChild(el("svg:polyline", { class: "line", points: pts.join(" "), stroke: PALETTE[i % PALETTE.length], "data-job": s.job, "data-points": String(pts.length) }));
    });
  }

  function drawUtil(status, jobs) {
    const box = $("util");
    box.replaceChildren();
    let rows = 0;
    for (const j of jobs) {
      const hist = historyOf(status, j).filter((r) => Array.isArray(r.stages) && r.step_time_s > 0).slice(-UTIL_WINDOW);
      if (!hist.length) continue;
      const acc = {};
      for (const r of hist) for (const s of r.stages) {
        const a = (acc[s.stage] = acc[s.stage] || { c: 0, w: 0, n: 0 });
        a.c += (s.compute_s || 0) / r.step_time_s; a.w += (s.wait_s || 0) / r.step_time_s; a.n += 1;
      }
      const peerOf = Object.fromEntries((j.stages || []).map((s) => [s.stage, s.peer]));
      for (const st of Object.keys(acc).sort((a, b) => a - b)) {
        const a = acc[st], c = Math.min(1, a.c / a.n), w = Math.min(1 - c, a.w / a.n);
        const row = el("div", { class: "bar-row", "data-stage": st, "data-util": c.toFixed(3) });
        row.appendChild(el("span", { class: "mono", title: peerOf[st] || "" }, (jobs.length > 1 ? j.job + " " : "") + "S" + st + " " + shortId(peerOf[st] || "")));
        const bar = el("div", { class: "bar" });
        bar.appendChild(el("div", { class: "compute", style: "width:" + (c * 100).toFixed(1) + "%", title: "compute" }));
        bar.appendChild(el("div", { class: "wait", style: "width:" + (w * 100).toFixed(1) + "%", title: "waiting" }));
        row.append(bar, el("span", {}, (c * 100).toFixed(0) + "%"));
        box.appendChild(row);
        rows++;
      }
    }
    $("util-empty").classList.toggle("hidden", rows > 0);
    if (rows) box.appendChild(el("div", { class: "legend" }, "")).append(
      el("span", { style: "--c:#3ecf8e" }, "compute"), el("span", { style: "--c:#d6a94a" }, "waiting for neighbours"));
  }

  function drawTables(status, jobs) {
    const tb = $("jobs").tBodies[0];
    tb.replaceChildren();
    for (const j of jobs) {
      const tr = el("tr", { "data-job": j.job });
      const last = historyOf(status, j).slice(-1)[0];
      [j.job, j.model, j.state, j.step + " / " + j.steps, fmt(j.loss, 4), fmt(j.tokens_per_s, 0),
       "v" + j.plan_version + (last && last.wire_bytes ? " · " + fmtBytes(last.wire_bytes) + "/step" : ""),
       (j.stages || []).map((s) => "S" + s.stage + "→" + shortId(s.peer)).join("  ")].forEach((v, i) =>
        tr.appendChild(el("td", { class: i === 0 || i === 7 ? "mono" : "" }, String(v))));
      tb.appendChild(tr);
    }
    $("jobs-empty").classList.toggle("hidden", jobs.length > 0);
    const pb = $("peers").tBodies[0];
    pb.replaceChildren();
    for (const p of status.peers || []) {
      const d = p.device || {};
      const tr = el("tr", { "data-peer-id": p.peer_id });
      [shortId(p.peer_id) + (p.peer_id === status.peer_id ? " *" : ""), (d.kind || "?") + " " + (d.name || ""),
       fmt(d.tflops_fp32, 2), fmtBytes(d.memory_total_bytes), (p.roles || []).join(","), p.availability || "?"]
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
    const jobs = status.jobs || [];
    const dev = status.device || {};
    $("self").textContent = (status.peer_id || "?") + " · " + (dev.kind || "?") + " " + (dev.name || "") +
      " · roles " + (status.roles || []).join(",") + " · up " + fmt(status.uptime_s, 0) + " s";
    drawSwarm(status);
    const series = jobs.map((j) => ({ job: j.job, points: historyOf(status, j) }));
    drawChart($("loss"), series, "loss", 3);
    drawChart($("tput"), series, "tokens_per_s", 0);
    drawUtil(status, jobs);
    drawTables(status, jobs);
  }

  async function poll() {
    try {
      const r = await fetch("api/status", { cache: "no-store" });
      if (!r.ok) throw new Error("HTTP " + r.status);
      render(await r.json());
      polls++;
      document.body.dataset.polls = String(polls);
      document.body.dataset.state = "ok";
      $("conn").textContent = "live"; $("conn").className = "pill ok";
    } catch (e) {
      document.body.dataset.state = "error";
      $("conn").textContent = "offline: " + e.message; $("conn").className = "pill bad";
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }
  poll();
})();
