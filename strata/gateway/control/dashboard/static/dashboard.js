/* The Strata dashboard: polls GET /dashboard/data every second and draws it.
 *
 * No framework and nothing from another origin. Every value goes in with textContent (instance
 * ids, URIs and reasons come from the registry). The data takes a key: an API key shows the
 * fleet read-only, the admin key adds the buttons, instance URLs and model URIs. The key stays in
 * this page's memory and is sent to this gateway only; the gateway checks it on every call. */
(() => {
  "use strict";

  const POLL_MS = 1000;
  const CHART_HEIGHT = 150;
  const GONE_SHOWN_S = 30;
  const CHARTS = [ // element id, then [label, series column, colour] per line
    ["chart-requests", [["answers/s", "answers_per_s", "#2b6cb0"],
                        ["failed/s", "failures_per_s", "#c53030"]]],
    ["chart-ttft", [["mean", "ttft_ms_mean", "#2f855a"], ["max", "ttft_ms_max", "#b7791f"]]],
    ["chart-itl", [["mean", "itl_ms_mean", "#6b46c1"]]],
    ["chart-tokens", [["tokens/s", "output_tokens_per_s", "#2c7a7b"]]],
  ];
  const state = {key: "", access: {admin: false, keyed: true}, charts: null, rows: new Map()};
  const $ = (id) => document.getElementById(id);

  function el(tag, props = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(props)) {
      if (name === "class") node.className = value;
      else if (name === "data") Object.assign(node.dataset, value);
      else if (name === "text") node.textContent = value;
      else node[name] = value;
    }
    node.append(...children);
    return node;
  }
  const pct = (x) => (x == null ? "–" : `${Math.round(x * 100)}%`);
  const ago = (s) => (s == null ? "–" : `${s.toFixed(1)} s ago`);
  const clock = (t) => new Date(t * 1000).toLocaleTimeString();
  const authHeaders = () => (state.key ? {Authorization: `Bearer ${state.key}`} : {});

  function say(kind, text) {
    const box = $("message");
    box.hidden = false;
    box.dataset.kind = kind;
    box.textContent = text;
  }

  async function refresh() {
    try {
      const response = await fetch("/dashboard/data", {headers: authHeaders(), cache: "no-store"});
      if (response.status === 401 || response.status === 403) {
        document.body.classList.add("stale");
        $("summary").textContent = state.key ? "that key is not accepted: enter another"
          : "enter a key: an API key shows the fleet, the admin key adds the buttons";
        return null;
      }
      if (!response.ok) throw new Error(`the gateway answered ${response.status}`);
      const data = await response.json();
      render(data);
      document.body.classList.remove("stale");
      return data;
    } catch (error) {
      document.body.classList.add("stale");
      $("summary").textContent = `cannot reach the gateway: ${error.message}`;
      return null;
    }
  }

  async function loop() {
    await refresh();
    setTimeout(loop, POLL_MS);
  }

  function render(data) {
    state.access = data.access;
    renderSummary(data);
    renderInstances(data);
    renderModels(data);
    renderReleases(data.releases);
    renderCharts(data.series);
    renderSessions(data);
    renderAutoscaler(data.autoscaler);
    renderTenants(data.tenants);
    renderAdapters(data.adapters);
    renderSlow(data.slow_requests, data.trace_url);
    const errors = data.errors.length ? ` · could not read: ${data.errors.join(" · ")}` : "";
    $("footer").textContent = `updated ${clock(data.now)}${errors}`;
    document.body.dataset.updated = String(data.now);
  }

  function renderSummary(data) {
    const g = data.gateway;
    $("summary").textContent = `gateway :${g.port} · policy ${g.policy} · ` +
      `${g.num_routable}/${g.num_instances} routable · ${g.num_in_flight} in flight · ` +
      `${g.num_queued} queued`;
    const badge = $("access");
    const access = data.access;
    badge.textContent = !access.keyed ? "admin API open (no keys)"
      : access.admin ? "admin" : "read-only";
    badge.dataset.admin = String(access.admin);
  }

  // Instances: one row per id, updated in place so that a button is never swapped under a click.
  function renderInstances(data) {
    const body = $("instances").tBodies[0];
    const seen = new Set();
    data.instances.forEach((inst, index) => {
      seen.add(inst.instance_id);
      let row = state.rows.get(inst.instance_id);
      if (!row) {
        row = instanceRow(inst.instance_id);
        state.rows.set(inst.instance_id, row);
      }
      fillInstance(row, inst);
      if (body.children[index] !== row) body.insertBefore(row, body.children[index] || null);
    });
    for (const [id, row] of state.rows) {
      if (!seen.has(id)) leave(id, row, data.now);
    }
    $("no-instances").hidden = state.rows.size > 0;
  }

  // An instance that left the registry stays listed as gone for a while, then goes.
  function leave(id, row, now) {
    if (row.dataset.status !== "gone") {
      row.dataset.status = "gone";
      row.dataset.goneAt = String(now);
      row.cells[4].textContent = "gone";
      row.cells[4].className = "status status-gone";
      row.cells[10].firstChild.disabled = true;
    } else if (now - Number(row.dataset.goneAt) > GONE_SHOWN_S) {
      row.remove();
      state.rows.delete(id);
    }
  }

  function instanceRow(id) {
    const button = el("button", {type: "button", class: "drain", text: "Drain"});
    button.addEventListener("click", () => drain(id));
    const cells = Array.from({length: 10}, (_, i) => el("td", {class: i >= 5 ? "num" : ""}));
    return el("tr", {data: {instance: id}}, ...cells, el("td", {}, button));
  }

  function fillInstance(row, inst) {
    const load = inst.load;
    const values = [inst.instance_id,
      `${inst.model}@${inst.version}${inst.simulated ? " (simulated)" : ""}`, inst.role,
      inst.pool, inst.status, String(load.num_in_flight),
      `${load.num_running} / ${load.num_waiting}`, pct(load.kv_usage),
      pct(inst.prefix_hit_rate), ago(inst.heartbeat_age_s)];
    values.forEach((value, i) => {
      if (row.cells[i].textContent !== value) row.cells[i].textContent = value;
    });
    row.dataset.status = inst.status;
    row.cells[0].title = inst.node ? `node ${inst.node}` : "";
    row.cells[4].className = `status status-${inst.status}`;
    const button = row.cells[10].firstChild;
    button.disabled = !state.access.admin || ["draining", "dead"].includes(inst.status);
    button.title = state.access.admin ? `stop routing to ${inst.instance_id} and drain it`
      : "read-only: enter the admin key to drain";
  }

  // Models and releases change rarely: redrawn only when what they show changed.
  function redraw(container, content, draw) {
    const signature = JSON.stringify(content);
    if (container.dataset.signature === signature) return;
    container.dataset.signature = signature;
    container.replaceChildren(...draw());
  }

  function renderModels(data) {
    const busy = new Set(data.releases.filter((r) => !r.is_terminal).map((r) => r.name));
    const canRelease = state.access.admin && data.control.releases;
    redraw($("models"), [data.models, [...busy], canRelease], () => data.models.length
      ? data.models.map((model) => modelBlock(model, busy.has(model.name), canRelease))
      : [el("p", {class: "empty", text: "No model is known to this gateway."})]);
  }

  function modelBlock(model, isBusy, canRelease) {
    const r = model.routing;
    const pointers = r ? [r.live && `live ${r.live}`,
      r.canary && `canary ${r.canary} at ${pct(r.canary_weight)}`,
      r.previous && `previous ${r.previous}`].filter(Boolean).join(" · ")
      : "no routing record: any version serves";
    const rollback = el("button", {type: "button", class: "rollback", text: "Rollback",
      disabled: !canRelease || !(isBusy || (r && r.previous)),
      title: isBusy ? "roll back the release in progress" : "make the previous version live again"});
    rollback.addEventListener("click", () => rollbackModel(model.name));
    const rows = model.versions.map((v) => versionRow(model.name, v, isBusy, canRelease));
    const head = el("tr", {}, ...["version", "part", "routable / desired", "instances", "uri", ""]
      .map((text) => el("th", {text})));
    return el("div", {class: "model", data: {model: model.name}},
      el("h3", {}, el("span", {text: model.name}), el("span", {class: "pointers", text: pointers}),
        rollback),
      el("table", {class: "versions"}, el("thead", {}, head), el("tbody", {}, ...rows)));
  }

  function versionRow(name, v, isBusy, canRelease) {
    const actions = el("td");
    if (v.part !== "live" && v.uri) {
      for (const [label, strategy] of [["Release", "blue-green"], ["Canary", "canary"]]) {
        const button = el("button", {type: "button", class: `release-${strategy}`, text: label,
          disabled: !canRelease || isBusy,
          title: isBusy ? "a release of this model is in progress" : `${strategy} release`});
        button.addEventListener("click", () => release(name, v.version, strategy));
        actions.append(button);
      }
    }
    const desired = v.desired_replicas == null ? "–" : String(v.desired_replicas);
    const uri = `${v.uri || "–"}${v.simulated ? " (simulated)" : ""}`;
    return el("tr", {data: {version: v.version, part: v.part || ""}},
      el("td", {text: v.version}), el("td", {class: `part part-${v.part}`, text: v.part || ""}),
      el("td", {text: `${v.num_routable} / ${desired}`}),
      el("td", {text: String(v.num_instances)}), el("td", {class: "uri", text: uri}), actions);
  }

  function renderReleases(releases) {
    redraw($("releases"), releases, () => releases.length ? releases.map(releaseBlock)
      : [el("p", {class: "empty", text: "No release yet."})]);
  }

  function releaseBlock(r) {
    const steps = r.steps.map((step) => el("li",
      {class: `step step-${step.status}`, data: {state: step.state, status: step.status}},
      el("span", {text: step.state.replace("_", " ")}),
      el("small", {text: step.entered_at == null ? ""
        : `+${(step.entered_at - r.created_at).toFixed(1)} s`})));
    const title = `${r.name}: ${r.from_version || "—"} → ${r.to_version} · ${r.strategy}` +
      ` · ${r.state}${r.is_terminal ? "" : " (in progress)"}`;
    return el("div", {class: `release release-${r.state}`,
                      data: {release: r.release_id, state: r.state, model: r.name}},
      el("h3", {text: title}), el("ol", {class: "steps"}, ...steps),
      el("p", {class: "reason", text: r.reason || ""}));
  }

  function renderCharts(series) {
    if (typeof uPlot === "undefined") return;
    if (!state.charts) state.charts = CHARTS.map(([id, lines]) => makeChart($(id), lines));
    state.charts.forEach((chart, i) => {
      chart.setData([series.t, ...CHARTS[i][1].map(([, column]) => series[column])]);
    });
  }

  function makeChart(target, lines) {
    const opts = {
      width: chartWidth(target), height: CHART_HEIGHT, legend: {live: false},
      scales: {x: {time: true}, y: {range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1]}},
      series: [{}, ...lines.map(([label, , stroke]) => ({label, stroke, width: 1.5}))],
      axes: [{}, {size: 48}],
    };
    return new uPlot(opts, [[], ...lines.map(() => [])], target);
  }

  const chartWidth = (target) => Math.max(240, target.clientWidth - 4);

  window.addEventListener("resize", () => {
    if (!state.charts) return;
    state.charts.forEach((chart, i) => {
      chart.setSize({width: chartWidth($(CHARTS[i][0])), height: CHART_HEIGHT});
    });
  });

  function renderSessions(data) {
    const sessions = data.sessions;
    const facts = [["session routing", sessions.mode]];
    if (sessions.pinned) {
      const each = Object.entries(sessions.pinned).map(([id, n]) => `${id}: ${n}`).join(", ");
      facts.push(["pinned sessions", `${sessions.num_pinned}${each ? ` (${each})` : ""}`]);
    }
    const cache = data.caches.response;
    facts.push(["response cache", cache
      ? `${pct(cache.hit_rate)} hit rate (${cache.hits} hits, ${cache.misses} misses)` : "off"]);
    facts.push(["prefix cache, mean of instances", pct(data.caches.prefix_hit_rate_mean)]);
    redraw($("sessions"), facts, () => facts.flatMap(([term, value]) =>
      [el("dt", {text: term}), el("dd", {text: value})]));
  }

  function renderAutoscaler(status) {
    $("autoscaler-section").hidden = !status;
    if (!status) return;
    $("autoscaler-by").textContent = `decided by ${status.owner} at ${clock(status.decided_at)}`;
    redraw($("autoscaler").tBodies[0], status.targets, () => status.targets.map((t) =>
      el("tr", {data: {target: `${t.model}@${t.version}`}},
        ...[`${t.model}@${t.version}`, t.role, t.pool].map((text) => el("td", {text})),
        ...[t.desired, t.actual].map((n) => el("td", {class: "num", text: String(n)})),
        el("td", {text: t.reason}))));
  }

  // Tenants: what each used over the window (summed over every gateway sharing the usage
  // store); a client key sees its own row only.
  function renderTenants(tenants) {
    $("tenants-section").hidden = !tenants;
    if (!tenants) return;
    $("tenants-window").textContent = `last ${Math.round(tenants.window_s / 60)} minutes`;
    $("no-tenants").hidden = tenants.rows.length > 0;
    redraw($("tenants").tBodies[0], tenants.rows, () => tenants.rows.map((t) =>
      el("tr", {data: {tenant: t.tenant}}, el("td", {text: t.tenant}),
        ...[t.requests, t.errors, t.rate_limited, t.prompt_tokens, t.cached_tokens,
            t.completion_tokens].map((n) => el("td", {class: "num", text: String(n)})))));
  }

  // LoRA adapters (--policy adapter_aware): k, share of the requests, residency over the
  // instances that know each, loads and evictions summed over them, the mean last load time.
  function renderAdapters(adapters) {
    $("adapters-section").hidden = !adapters;
    if (!adapters) return;
    $("no-adapters").hidden = adapters.length > 0;
    redraw($("adapters").tBodies[0], adapters, () => adapters.map((a) =>
      el("tr", {data: {adapter: a.adapter}}, el("td", {text: a.adapter}),
        ...[String(a.replicas), `${(100 * a.share).toFixed(1)} %`,
            `${a.num_resident} / ${a.num_instances}`, String(a.num_loads),
            String(a.num_evictions), a.load_s ? `${Math.round(1000 * a.load_s)} ms` : "-"]
          .map((text) => el("td", {class: "num", text})))));
  }

  // The slowest first bytes of the window (the admin's view), each with its trace when the
  // request was traced: a link where the gateway has a --trace-url, else the id to look up.
  function renderSlow(slow, traceUrl) {
    $("slow-section").hidden = !slow.length;
    redraw($("slow").tBodies[0], [slow, traceUrl], () => slow.map((s) => {
      const trace = !s.trace_id ? el("td", {text: "not traced"})
        : traceUrl ? el("td", {}, el("a", {href: traceUrl.replace("{trace_id}", s.trace_id),
                                             text: s.trace_id, rel: "noreferrer"}))
        : el("td", {text: s.trace_id});
      return el("tr", {data: {request: s.request_id || ""}}, el("td", {text: clock(s.at)}),
        el("td", {class: "num", text: `${Math.round(s.ttft_ms)} ms`}),
        el("td", {text: s.instance_id}), el("td", {text: s.request_id || ""}), trace);
    }));
  }

  // The buttons: each calls the gateway's admin API with the key typed into the page.
  async function admin(what, method, path, body) {
    const headers = {...authHeaders(), ...(body ? {"Content-Type": "application/json"} : {})};
    let response;
    try {
      response = await fetch(path, {method, headers, body: body && JSON.stringify(body)});
    } catch (error) {
      say("error", `${what}: ${error.message}`);
      return;
    }
    let detail = "";
    try {
      const answer = await response.json();
      detail = answer.error ? answer.error.message : "";
    } catch (error) { /* not JSON: the status says enough */ }
    if (response.ok) say("ok", `${what}: accepted (${response.status})`);
    else say("error", `${what}: refused (${response.status})${detail ? `: ${detail}` : ""}`);
    refresh();
  }

  function drain(id) {
    if (!confirm(`Drain ${id}? The gateway stops routing to it now; it finishes its requests.`)) {
      return;
    }
    admin(`drain ${id}`, "POST", `/admin/instances/${encodeURIComponent(id)}/drain`);
  }

  function release(name, version, strategy) {
    if (!confirm(`Start a ${strategy} release of ${name}@${version}?`)) return;
    admin(`release ${name}@${version}`, "POST", "/admin/releases",
          {model: `${name}@${version}`, strategy});
  }

  function rollbackModel(name) {
    if (!confirm(`Roll back ${name}?`)) return;
    admin(`rollback ${name}`, "POST", `/admin/models/${encodeURIComponent(name)}/rollback`);
  }

  $("key-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    state.key = $("admin-key").value.trim();
    const data = await refresh();
    if (!state.key) return;
    if (!data) say("error", "that key is not accepted");
    else if (data.access.admin) say("ok", "key accepted: the buttons are on");
    else say("error", "that key shows the fleet but is not the admin key: read-only");
  });

  loop();
})();
