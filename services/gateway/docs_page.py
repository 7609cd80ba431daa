"""``GET /docs``: the gateway's API reference as one self-contained HTML page, rendered in the
browser from ``/openapi.json`` (the same document schemathesis checks). It loads nothing from
anywhere else — no CDN, no font, no script from outside — so it renders behind a firewall and
offline; the page's Content-Security-Policy lets it reach only its own origin."""

from __future__ import annotations

CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self'"

PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>BEAR gateway — API reference</title>
<style>
body { font: 15px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 980px; padding: 1em 1.5em; color: #1b1b1b; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
.op { border: 1px solid #d6d6d6; border-radius: 6px; margin: 0.8em 0; }
.op > summary { cursor: pointer; padding: 0.5em 0.8em; list-style: none; }
.verb { display: inline-block; min-width: 3.6em; font-weight: 600; text-transform: uppercase; }
.post { color: #1a5fb4; } .get { color: #26a269; }
.path { font-family: ui-monospace, monospace; }
.body { padding: 0 0.9em 0.8em; }
pre { background: #f6f6f6; padding: 0.6em; overflow-x: auto; font-size: 13px; }
.lock { color: #a51d2d; font-size: 0.85em; margin-left: 0.6em; }
#error { color: #a51d2d; }
</style>
</head>
<body>
<h1 id="title">BEAR gateway</h1>
<p>OpenAI-compatible API; the model <code>bear</code> lets BEAR choose model and instance.
Requests marked <span class="lock">key</span> need <code>Authorization: Bearer &lt;key&gt;</code>.
The machine-readable document: <a href="openapi.json">openapi.json</a>.</p>
<p id="error"></p>
<div id="ops"></div>
<h2>Schemas</h2>
<div id="schemas"></div>
<script>
"use strict";
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}
function block(title, value) {
  const d = el("div");
  d.appendChild(el("h4", "", title));
  d.appendChild(el("pre", "", JSON.stringify(value, null, 2)));
  return d;
}
fetch("openapi.json").then(r => r.json()).then(doc => {
  document.getElementById("title").textContent = doc.info.title + " " + doc.info.version;
  const ops = document.getElementById("ops");
  for (const [path, item] of Object.entries(doc.paths)) {
    for (const [verb, op] of Object.entries(item)) {
      const d = el("details", "op");
      const s = el("summary");
      s.appendChild(el("span", "verb " + verb, verb));
      s.appendChild(el("span", "path", path));
      s.appendChild(el("span", "", " — " + (op.summary || "")));
      if (op.security) s.appendChild(el("span", "lock", "key"));
      d.appendChild(s);
      const b = el("div", "body");
      if (op.parameters) b.appendChild(block("parameters", op.parameters));
      if (op.requestBody) b.appendChild(block("request body", op.requestBody.content["application/json"].schema));
      b.appendChild(block("responses", Object.fromEntries(Object.entries(op.responses).map(
        ([code, r]) => [code, r.description]))));
      d.appendChild(b);
      ops.appendChild(d);
    }
  }
  const schemas = document.getElementById("schemas");
  for (const [name, schema] of Object.entries(doc.components.schemas)) {
    const d = el("details", "op");
    d.appendChild(el("summary", "path", name));
    const b = el("div", "body");
    b.appendChild(el("pre", "", JSON.stringify(schema, null, 2)));
    d.appendChild(b);
    schemas.appendChild(d);
  }
}).catch(e => { document.getElementById("error").textContent = "could not load openapi.json: " + e; });
</script>
</body>
</html>
"""
