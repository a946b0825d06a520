"""A distillation teacher at ``urls`` (servers already running) is asked for its tokenizer's folder
(``GET /model_info``'s ``tokenizer_path``, as SGLang and the reference server answer it) and checked
against the policy's before the run starts: another tokenizer stops the run with one line, a
folder not on this machine is said to be unchecked, and servers that do not answer stop the run.
The servers here answer ``/model_info`` only (a stdlib HTTP server): the check is what is tested."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from nodes.inference.models import ensure_tiny_checkpoint
from recipes.gsm8k_config import ConfigError, RecipeConfig, load_config
from recipes.gsm8k_plane import check_teacher_tokenizer


@contextmanager
def model_info_server(tokenizer_path: str) -> Iterator[str]:
    body = json.dumps({"model_path": tokenizer_path, "tokenizer_path": tokenizer_path}).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/model_info" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def config(urls: list[str]) -> RecipeConfig:
    return load_config(None, [f"models.teacher.urls={json.dumps(urls)}", "distill.teacher=teacher"])


def test_a_teacher_at_urls_with_the_policys_tokenizer_passes() -> None:
    tiny = ensure_tiny_checkpoint()
    with model_info_server(str(tiny)) as url:
        assert check_teacher_tokenizer(config([url]), tiny) is None


def test_a_teacher_at_urls_with_another_tokenizer_stops_the_run(tmp_path: Path) -> None:
    tiny = ensure_tiny_checkpoint()
    other = tmp_path / "other-teacher"
    shutil.copytree(tiny, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]  # two ids swapped: the same size, another mapping
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with model_info_server(str(other)) as url, pytest.raises(ConfigError) as e:
        check_teacher_tokenizer(config([url]), tiny)
    assert str(e.value).startswith("distill.teacher = 'teacher': its tokenizer")
    assert "2 ids mapped differently" in str(e.value) and "\n" not in str(e.value)


def test_a_teacher_whose_tokenizer_is_on_another_machine_is_said_to_be_unchecked() -> None:
    with model_info_server("/models/on-another-host") as url:
        line = check_teacher_tokenizer(config([url]), ensure_tiny_checkpoint())
    assert line is not None and "/models/on-another-host" in line and "not checked" in line


def test_teacher_servers_that_do_not_answer_stop_the_run() -> None:
    with model_info_server("unused") as url:
        pass  # closed: nothing listens there now
    with pytest.raises(ConfigError) as e:
        check_teacher_tokenizer(config([url]), ensure_tiny_checkpoint())
    assert str(e.value).startswith("models.teacher.urls: no server told its tokenizer")
    assert "are they running?" in str(e.value)
