"""`strata serve` builds the model on one thread so that only the engine thread owns an OpenMP
team, then hands the configured thread count to the engine thread."""

from __future__ import annotations

import threading

import torch

from strata.commands.serve_parallel import openmp_free_main_thread


def seen_by_a_new_thread() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def test_building_runs_on_one_thread_and_a_later_thread_gets_the_setting() -> None:
    before = torch.get_num_threads()
    try:
        with openmp_free_main_thread(3):  # 3: not this machine's default, so it is visible
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 3
        assert seen_by_a_new_thread() == 3
        with openmp_free_main_thread(None):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 3  # None keeps what torch had
    finally:
        torch.set_num_threads(before)
