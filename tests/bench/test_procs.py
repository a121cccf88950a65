"""The process helper shared by tests and benchmarks, and the Redis it starts: real processes."""

from __future__ import annotations

import signal
import socket
import sys
from pathlib import Path

import pytest
import redis
from harness.procs import spawn, wait_until
from redis_server import RedisServer

SERVER = ("import sys, time\nprint('listening on 4242', flush=True)\n"
          "if 'crash' in sys.argv: sys.exit(3)\n"
          "if 'port' in sys.argv:\n"
          "    print('OSError: [Errno 98] Address already in use')\n"
          "    sys.exit(1)\n"
          "time.sleep(60)\n")


def python(*args: str) -> list[str]:
    return [sys.executable, "-c", SERVER, *args]


def test_a_process_is_ready_on_its_output_restarted_with_its_log_kept_and_stopped(
        tmp_path: Path) -> None:
    proc = spawn("server", python(), tmp_path)
    assert proc.wait_for_output(r"listening on (\d+)", timeout_s=30).group(1) == "4242"
    assert proc.kill() == -signal.SIGKILL  # a crash
    proc.start()  # the same command line; this start's output only
    assert proc.wait_for_output(r"listening on", timeout_s=30)
    assert proc.output().count("listening") == 1 and proc.log.read_text().count("listening") == 2
    assert proc.stop(timeout_s=10) == -signal.SIGTERM and not proc.is_running


def test_a_process_that_exits_fails_the_wait_at_once_with_its_output(tmp_path: Path) -> None:
    proc = spawn("crasher", python("crash"), tmp_path)
    with pytest.raises(RuntimeError, match=r"crasher exited with 3 .*\n.*listening on 4242"):
        proc.wait_for_output(r"never printed", timeout_s=60)
    assert not proc.lost_its_port
    lost = spawn("squatted", python("port"), tmp_path)
    with pytest.raises(RuntimeError, match="Address already in use"):
        lost.wait_for_output(r"never printed", timeout_s=60)
    assert lost.lost_its_port


def test_a_wait_is_bounded_and_says_what_it_waited_for() -> None:
    with pytest.raises(TimeoutError, match="timed out after 0.1s waiting for godot"):
        wait_until(lambda: False, 0.1, "godot")
    assert wait_until(lambda: True, 0.1, "now") < 0.1


def test_redis_moves_to_another_port_when_its_first_one_was_taken(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    with socket.socket() as squatter:  # takes the port found free before redis-server binds it
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        server.port = squatted = squatter.getsockname()[1]
        server.start()
        try:
            assert server.port != squatted
            with redis.Redis.from_url(server.url) as client:
                assert client.ping()
                assert client.info("server")["process_id"] == server.proc.pid  # ours
        finally:
            server.stop()
