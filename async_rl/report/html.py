"""One self-contained HTML page (inline CSS, no scripts, nothing fetched) showing the report's PNGs
next to it, a summary table, what could not be drawn and the run's config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jinja2

_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>async_rl report: {{ name }}</title>
<style>
body { font-family: system-ui, sans-serif; max-width: 1320px; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
td { border-bottom: 1px solid #ddd; padding: 4px 14px 4px 0; vertical-align: top; }
td:first-child { color: #555; }
img { max-width: 100%; border: 1px solid #eee; }
.note { color: #8a5a00; margin: 0.3em 0; }
.about { color: #444; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 12px; }
</style>
</head>
<body>
<h1>async_rl run report: {{ name }}</h1>
<table>
{% for label, value in summary %}<tr><td>{{ label }}</td><td>{{ value }}</td></tr>
{% endfor %}</table>
{% for s in sections %}
<section id="{{ s.name }}">
<h2>{{ s.title }}</h2>
<p class="about">{{ s.about }}</p>
{% for note in s.notes %}<p class="note">{{ note }}</p>
{% endfor %}{% if s.image %}<img src="{{ s.image }}" alt="{{ s.title }}">{% endif %}
</section>
{% endfor %}
{% if config_text %}<h2>Config</h2>
<details><summary>config.yaml</summary><pre>{{ config_text }}</pre></details>{% endif %}
<p class="about">Written by <code>async-rl report {{ run_dir }}</code>. TensorBoard: <code>tensorboard --logdir {{ run_dir }}/tensorboard</code></p>
</body>
</html>
"""


@dataclass(frozen=True)
class Section:
    name: str
    title: str
    about: str
    image: str | None  # PNG file name next to the page, None when nothing could be drawn
    notes: list[str]


def render(*, name: str, run_dir: str, summary: list[tuple[str, str]], sections: list[Section],
           config_text: str = "") -> str:
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(_TEMPLATE).render(name=name, run_dir=run_dir, summary=summary, sections=sections,
                                             config_text=config_text)


def write_page(path: Path, **kwargs) -> Path:
    path.write_text(render(**kwargs))
    return path
