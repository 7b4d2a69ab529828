"""Fixtures shared by the engine's tests."""
import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Compute on one thread for a module's tests: the ops are tiny, a second thread only syncs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
