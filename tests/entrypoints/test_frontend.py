"""The page at `/` without a browser: its routes and key rules, its files, and the dashboard's history.

The app is built around a stand-in engine (nothing here runs a model) and called straight through
ASGI; the history runs on a clock the test moves. tests/entrypoints/test_frontend_browser.py drives the
page itself in a browser, against real servers (and `--disable-frontend` through the command line).
"""
import asyncio
import json
import re
import types

import pytest

for module in ("fastapi", "uvicorn", "prometheus_client", "zmq", "msgspec"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")

from nanopaged.entrypoints.core_messages import Figures  # noqa: E402
from nanopaged.entrypoints.openai.app import build_app  # noqa: E402
from nanopaged.entrypoints.openai.dashboard import FiguresHistory  # noqa: E402
from nanopaged.entrypoints.openai.frontend import FILES, FOLDER  # noqa: E402
from nanopaged.entrypoints.openai.limits import BodyLimits  # noqa: E402
from nanopaged.entrypoints.openai.metrics import ServerMetrics  # noqa: E402
from nanopaged.entrypoints.openai.served_models import ServedModels  # noqa: E402

KEY = "sesame"
SVG_NAMESPACE = "http://www.w3.org/2000/svg"     # a name in app.js, never fetched


def app_with(api_key=None, frontend=True, metrics=None):
    engine = types.SimpleNamespace(config=types.SimpleNamespace(runner="generate"), tokenizer=None)
    return build_app(engine, metrics or ServerMetrics(), ServedModels("tiny", "/nowhere", 64),
                     BodyLimits(1 << 20, 10.0), api_key=api_key, frontend=frontend)


def get(app, path: str, key: str | None = None) -> tuple[int, dict, bytes]:
    """One GET straight into the ASGI app: (status, headers, body)."""
    messages = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        messages.append(message)

    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in messages if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


def figures(running=0, waiting=0, kv=0.0, preemptions=0, queries=0, hits=0, tokens=0) -> Figures:
    return Figures(running, waiting, kv, preemptions, queries, hits, tokens)


# ---- routes and the key --------------------------------------------------------------------------
@pytest.mark.parametrize("path", list(FILES))
def test_the_page_files_load_without_the_key(path):
    status, headers, body = get(app_with(api_key=KEY), path)
    assert status == 200 and body == (FOLDER / FILES[path][0]).read_bytes()
    assert headers["content-type"].startswith(FILES[path][1].split(";")[0])


@pytest.mark.parametrize("path", ["/dashboard.json", "/v1/models", "/engine_stats"])
def test_every_route_the_page_reads_needs_the_key(path):
    app = app_with(api_key=KEY)
    assert get(app, path)[0] == 401
    assert get(app, path, key="wrong")[0] == 401
    assert get(app, path, key=KEY)[0] == 200


def test_disable_frontend_leaves_no_page_and_no_feed():
    app = app_with(frontend=False)
    for path in [*FILES, "/dashboard.json"]:
        assert get(app, path)[0] == 404, path
    assert get(app_with(api_key=KEY, frontend=False), "/")[0] == 401     # nothing is left open in its place


def test_the_feed_shows_the_figures_the_metrics_received():
    metrics = ServerMetrics()
    metrics.engine(figures(running=3, waiting=2, kv=0.5, preemptions=4, queries=10, hits=5, tokens=7))
    status, _, body = get(app_with(metrics=metrics), "/dashboard.json")
    feed = json.loads(body)
    assert status == 200 and feed["window_s"] == metrics.history.window_s
    now, chart = feed["now"], feed["points"][-1]
    assert (now["num_running"], now["num_waiting"], now["kv_cache_usage"], now["num_preemptions"]) == (3, 2, 0.5, 4)
    assert (chart["num_running"], chart["kv_cache_usage"], chart["num_generated_tokens"]) == (3, 0.5, 7)


# ---- the files ----------------------------------------------------------------------------------
def test_the_page_names_no_remote_address():
    """The page must work on a machine with no internet: no CDN, no web font, no remote script."""
    for name, _ in FILES.values():
        text = (FOLDER / name).read_text().replace(SVG_NAMESPACE, "")
        assert not re.search(r"https?:|(?<![:\w])//[\w.-]+\.\w", text), name
        assert not re.search(r"@import|url\(", text), name


def test_the_content_security_policy_lets_the_page_load_only_its_own_files():
    _, headers, _ = get(app_with(), "/")
    assert "default-src 'self'" in headers["content-security-policy"]


def test_every_file_index_html_loads_is_served():
    html = (FOLDER / "index.html").read_text()
    linked = set(re.findall(r'(?:src|href)="(/[^"]*)"', html))
    assert linked and linked <= set(FILES), linked - set(FILES)


def test_every_element_app_js_looks_up_is_in_index_html():
    """A renamed id would leave a card or a button dead without a console error until it is used."""
    html, js = (FOLDER / "index.html").read_text(), (FOLDER / "app.js").read_text()
    ids = set(re.findall(r'id="([\w-]+)"', html))
    cards = re.search(r"const CARDS = \{(.*?)\n\};", js, re.S).group(1)
    wanted = set(re.findall(r'\$\("([\w-]+)"\)', js))
    for card in re.findall(r"^  (\w+): \{", cards, re.M):
        wanted |= {f"{card}-value", f"{card}-sub"}
        assert f'data-card="{card}"' in html, card
    assert len(wanted) > 15 and wanted <= ids, wanted - ids


# ---- the history ---------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_history_keeps_the_latest_figures_of_each_interval():
    clock = Clock()
    history = FiguresHistory(interval_s=1.0, window_s=60.0, clock=clock)
    for i in range(10):                                  # ten reports within one second
        clock.now = 1000.0 + i / 10
        history.add(figures(tokens=i))
    clock.now = 1001.0
    history.add(figures(tokens=20))
    points = history.points()
    assert [p["num_generated_tokens"] for p in points] == [9, 20]
    assert points[1]["generation_tokens_per_s"] == pytest.approx(11 / 0.1)


def test_history_keeps_each_gauge_s_highest_within_an_interval():
    """A burst that fills the cache and leaves within one interval still shows on the chart."""
    clock = Clock()
    history = FiguresHistory(interval_s=1.0, window_s=60.0, clock=clock)
    history.add(figures(running=4, waiting=3, kv=0.9))
    clock.now += 0.5
    history.add(figures(running=0, waiting=0, kv=0.0))
    (only,) = history.points()
    assert (only["num_running"], only["num_waiting"], only["kv_cache_usage"]) == (4, 3, 0.9)
    assert history.latest()["kv_cache_usage"] == 0.0 and history.latest()["num_running"] == 0


def test_history_rates_are_per_interval():
    clock = Clock()
    history = FiguresHistory(interval_s=1.0, window_s=60.0, clock=clock)
    history.add(figures(preemptions=1, queries=100, hits=10, tokens=50))
    clock.now += 1.0
    history.add(figures(preemptions=4, queries=300, hits=160, tokens=150))
    first, second = history.points()
    assert first["generation_tokens_per_s"] is None and first["preemptions"] is None
    assert second["generation_tokens_per_s"] == pytest.approx(100.0)
    assert second["prefix_cache_hit_rate"] == pytest.approx(150 / 200)
    assert second["preemptions"] == 3


def test_history_carries_the_last_figures_over_an_idle_gap():
    """No figures arrive while nothing changes: the rate after a long pause is not spread over it."""
    clock = Clock()
    history = FiguresHistory(interval_s=1.0, window_s=300.0, clock=clock)
    history.add(figures(tokens=100, kv=0.5))
    clock.now += 60.0
    history.add(figures(tokens=110))
    assert history.points()[-1]["generation_tokens_per_s"] == pytest.approx(10.0)
    clock.now += 30.0                                    # idle again: the state now is the last one
    last = history.points()[-1]
    assert last["age_s"] == 0 and last["num_generated_tokens"] == 110 and last["generation_tokens_per_s"] == 0


def test_history_forgets_what_is_older_than_its_window():
    clock = Clock()
    history = FiguresHistory(interval_s=1.0, window_s=10.0, clock=clock)
    for i in range(100):
        history.add(figures(tokens=i))
        clock.now += 1.0
    points = history.points()
    assert all(p["age_s"] <= 10.0 for p in points) and len(history.samples) <= history.samples.maxlen
    assert points[-1]["num_generated_tokens"] == 99 and len(points) <= 12


def test_history_refuses_an_interval_longer_than_its_window():
    with pytest.raises(ValueError, match="interval_s"):
        FiguresHistory(interval_s=10.0, window_s=5.0)
