"""The `strata` command line: flags, `models cached`, and serve + chat + bench end to end."""

from __future__ import annotations

import argparse
import io
import json
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_process import ServeProcess, start_serve

from strata.cli import COMMAND_NAMES, build_parser, cache_dir_from_env, main
from strata.clients.chat import ChatOptions, run_chat

# --- flags ----------------------------------------------------------------------------------------


def test_serve_defaults() -> None:
    args = build_parser().parse_args(["serve"])
    assert args.model is None and args.served_model_name is None
    assert (args.host, args.port) == ("127.0.0.1", 8000)
    assert args.device is None  # cuda when available, else cpu, decided at start
    assert args.dtype == "bfloat16"
    assert args.max_model_len is None  # min(model context, 2048)
    assert (args.kv_cache_gb, args.block_size) == (1.0, 16)
    assert (args.max_num_seqs, args.max_num_batched_tokens) == (64, None)
    assert not args.no_prefix_cache and not args.no_chunked_prefill
    assert (args.max_waiting, args.threads, args.shutdown_timeout_s) == (1024, None, 30.0)
    assert args.log_level == "info"


def _command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _flags(parser: argparse.ArgumentParser) -> list[tuple[object, ...]]:
    """Each flag's names, default and choices, and its subcommands' in turn."""
    found: list[tuple[object, ...]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found += [(name, *_flags(child)) for name, child in action.choices.items()]
        else:
            found.append((tuple(action.option_strings), action.dest, repr(action.default),
                          repr(action.choices)))
    return found


@pytest.mark.parametrize("command", COMMAND_NAMES)
def test_a_command_started_alone_parses_as_in_the_whole_parser(command: str) -> None:
    """`strata serve ...` builds its own subcommand only (no other command module imported):
    the flags it gets are the whole parser's, and the usage still names every command."""
    alone, whole = build_parser(command), build_parser()
    assert list(_command_parsers(alone)) == [command]
    assert _flags(_command_parsers(alone)[command]) == _flags(_command_parsers(whole)[command])
    assert alone.format_usage() == whole.format_usage()


def test_bench_and_chat_defaults_talk_to_loopback() -> None:
    bench = build_parser().parse_args(["bench"])
    assert bench.url == "http://127.0.0.1:8000"
    # no --num-requests: 32 for a load, 12 prompts for --check-determinism
    assert (bench.workload, bench.num_requests, bench.input_len, bench.output_len) == (
        "fixed", None, 128, 64)
    assert (bench.check_determinism, bench.batch_size, bench.api_key) == (False, 36, None)
    assert (bench.concurrency, bench.request_rate, bench.timeout_s) == (8, None, 600.0)
    chat = build_parser().parse_args(["chat", "--once", "hi"])
    assert (chat.url, chat.once, chat.model) == ("http://127.0.0.1:8000", "hi", None)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--port", "70000"], "argument --port: '70000' is not a port number (0-65535)"),
        (["serve", "--kv-cache-gb", "-1"], "argument --kv-cache-gb: '-1' is not a positive number"),
        (["serve", "--block-size", "x"], "argument --block-size: 'x' is not a positive integer"),
        (["serve", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["bench", "--concurrency", "2", "--request-rate", "3"],
         "argument --request-rate: not allowed with argument --concurrency"),
        (["bench", "--workload", "zipf"], "argument --workload: invalid choice: 'zipf'"),
        (["models"], "the following arguments are required: {add,list,pull,cached}"),
        (["release", "m@v2", "--strategy", "canary", "--weight", "1.5"],
         "argument --weight: a canary weight is a fraction in (0, 1), got 1.5"),
        (["release", "m@v2", "--strategy", "red-black"], "argument --strategy: invalid choice"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cache_dir_comes_from_strata_cache_dir_then_xdg_then_home() -> None:
    assert cache_dir_from_env({"STRATA_CACHE_DIR": "/c", "XDG_CACHE_HOME": "/x"}) == Path("/c")
    assert cache_dir_from_env({"XDG_CACHE_HOME": "/x"}) == Path("/x/strata")
    assert cache_dir_from_env({}) == Path.home() / ".cache" / "strata"


def test_models_cached_shows_each_alias_and_whether_it_is_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    assert main(["models", "cached"]) == 0
    path = tmp_path / "models" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == [
        "smollm2", "SmolLM2-135M-Instruct", "not", "cached", str(path), "(default)"]
    embed_dir = tmp_path / "models" / "minilm" / "all-MiniLM-L6-v2"
    assert lines[2].split() == ["minilm", "all-MiniLM-L6-v2", "not", "cached", str(embed_dir),
                                "(default,", "--task", "embed)"]
    path.parent.mkdir(parents=True)
    path.write_bytes(b"GGUF")
    assert main(["models", "cached"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[2] == "cached"


def test_serving_a_missing_path_is_an_error_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    assert main(["serve", str(tmp_path / "nope"), "--log-level", "error"]) == 1
    err = capsys.readouterr().err
    assert "strata serve: error:" in err and "not a known model alias" in err


def test_bench_without_a_server_says_so_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    assert main(["bench", "--url", f"http://127.0.0.1:{port}", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"strata bench: error: cannot reach http://127.0.0.1:{port}" in err


def test_chat_keeps_the_conversation_and_leaves_on_exit() -> None:
    bodies: list[dict[str, object]] = []

    def server(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        frames = [{"choices": [{"index": 0, "delta": {"content": piece}}]}
                  for piece in ("Hel", "lo")]
        sse = "".join(f"data: {json.dumps(f)}\n\n" for f in frames) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode())

    lines = iter(["hi", "", "again", "/exit", "never sent"])
    out = io.StringIO()
    options = ChatOptions(url="http://fake", system="Be brief.", max_tokens=7)
    assert run_chat(options, read_line=lambda _: next(lines), out=out,
                    transport=httpx.MockTransport(server)) == 0
    assert [[m["content"] for m in b["messages"]] for b in bodies] == [  # type: ignore[union-attr]
        ["Be brief.", "hi"], ["Be brief.", "hi", "Hello", "again"]]
    assert bodies[0]["max_tokens"] == 7 and bodies[0]["stream"] is True
    assert "model" not in bodies[0]  # the server picks its own model
    assert out.getvalue().count("Hello\n") == 2


def test_chat_with_a_session_sends_only_what_the_server_has_not_seen() -> None:
    seen: list[tuple[list[str], str | None, str | None]] = []

    def server(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(([m["content"] for m in body["messages"]],
                     request.headers.get("x-session-id"), request.headers.get("authorization")))
        frame = {"choices": [{"index": 0, "delta": {"content": "ok"}}]}
        sse = f"data: {json.dumps(frame)}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode())

    lines = iter(["one", "two", "/exit"])
    options = ChatOptions(url="http://fake", system="Be brief.", session_id="s-1", api_key="k")
    assert run_chat(options, read_line=lambda _: next(lines), out=io.StringIO(),
                    transport=httpx.MockTransport(server)) == 0
    assert seen == [(["Be brief.", "one"], "s-1", "Bearer k"), (["two"], "s-1", "Bearer k")]


# --- a live tiny server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    from tiny_models import make_tiny_model_dir

    root = tmp_path_factory.mktemp("cli")
    model_dir = make_tiny_model_dir(root / "tiny")
    args = [str(model_dir), "--dtype", "float32", "--kv-cache-gb", "0.01", "--log-level",
            "warning", "--served-model-name", "tiny", "--shutdown-timeout-s", "20"]
    server = start_serve(args, cache_dir=root / "cache", timeout_s=120)
    yield server
    server.stop()


def test_bench_against_a_live_server_writes_a_complete_report(
    live_server: ServeProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    argv = ["bench", "--url", live_server.url, "--num-requests", "6", "--input-len", "16",
            "--output-len", "5", "--concurrency", "3", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "tiny"
    assert (report["num_completed"], report["num_failures"]) == (6, 0)
    assert report["total_input_tokens"] == 6 * 16
    assert report["total_output_tokens"] == 6 * 5  # ignore_eos: exactly output-len each
    assert set(report["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
    assert "TTFT (MS)" in capsys.readouterr().out


def test_multi_turn_bench_and_chat_once_against_a_live_server(
    live_server: ServeProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "--url", live_server.url, "--workload", "multi-turn", "--sessions", "2",
            "--turns", "2", "--input-len", "3", "--output-len", "3", "--no-progress"]
    assert main(argv) == 0
    assert "4 ok, 0 failed" in capsys.readouterr().out
    assert main(["chat", "--url", live_server.url, "--once", "hello", "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.endswith("\n")


def test_sigterm_lets_the_stream_in_flight_finish_and_exits_0(live_server: ServeProcess) -> None:
    # Stops the module's server: it stays the last test of this file.
    body = {"prompt": "hi", "max_tokens": 120, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    with httpx.Client(base_url=live_server.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as resp:
            stream = resp.iter_lines()
            lines.append(next(stream))  # the stream is in flight
            live_server.proc.send_signal(signal.SIGTERM)
            lines += [line for line in stream if line]
    assert lines[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in "".join(lines)
    assert live_server.proc.wait(timeout=30) == 0


def test_serve_binds_a_tcp_socket_so_asyncio_disables_nagle() -> None:
    # asyncio sets TCP_NODELAY on accepted connections only when the listening socket's protocol
    # is TCP; with protocol 0 a proxied stream's first chunk waits ~40 ms for a delayed ACK.
    from strata.commands.serve_stack import _bind

    sock = _bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


def test_api_key_files_skip_blank_and_comment_lines_even_indented(tmp_path: Path) -> None:
    from strata.commands.env import read_api_keys

    keys = tmp_path / "keys"
    keys.write_text("# team\n  # indented note\n\n  k-one  \nk-two\nk-one\n")
    assert read_api_keys(keys, ("k-env", "k-two")) == ("k-one", "k-two", "k-env")


def test_up_passes_the_session_level_to_every_instance(tmp_path: Path) -> None:
    from strata.commands import up
    from strata.commands.env import CliEnv

    flags = ["--session-consistency", "session", "--session-flush-bound-ms", "50.0",
             "--session-write-queue", "64", "--session-redis-replicas", "1"]
    args = build_parser("up").parse_args(["up", "--simulate", "smollm2-cpu", *flags])
    config = up._config(args, CliEnv(cache_dir=tmp_path, run_dir=tmp_path / "run"))
    at = config.serve_args.index("--session-consistency")
    assert list(config.serve_args[at:at + len(flags)]) == flags
    with pytest.raises(SystemExit) as refused:  # a usage error at once, not N failed starts
        build_parser("up").parse_args(["up", "--session-consistency", "linearizable"])
    assert refused.value.code == 2


def test_up_deterministic_reaches_every_instance_s_serve(tmp_path: Path) -> None:
    from strata.commands import up
    from strata.commands.env import CliEnv

    env = CliEnv(cache_dir=tmp_path, run_dir=tmp_path / "run")
    on = up._config(build_parser("up").parse_args(["up", "--deterministic"]), env)
    off = up._config(build_parser("up").parse_args(["up", "--no-deterministic"]), env)
    unsaid = up._config(build_parser("up").parse_args(["up"]), env)
    assert on.serve_args.count("--deterministic") == 1
    assert off.serve_args.count("--no-deterministic") == 1
    assert not {"--deterministic", "--no-deterministic"} & set(unsaid.serve_args)
    serve = build_parser("serve")  # what each instance's `strata serve` makes of them
    assert serve.parse_args(["serve", *on.serve_args]).deterministic is True
    assert serve.parse_args(["serve", *off.serve_args]).deterministic is False
    assert serve.parse_args(["serve", *unsaid.serve_args]).deterministic is None  # its default


@pytest.mark.parametrize("argv", [
    ["serve", "--simulate", "synthetic", "--deterministic"],
    ["serve", "--task", "embed", "--deterministic"],
    ["up", "--simulate", "synthetic", "--deterministic"],
])
def test_deterministic_where_no_model_kernel_runs_is_refused_by_name(
        argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("STRATA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("STRATA_RUN_DIR", str(tmp_path / "run"))
    assert main([*argv, "--log-level", "error"]) == 1
    err = capsys.readouterr().err
    assert f"strata {argv[0]}: error:" in err and "--deterministic" in err
