import pytest

from tests.serve.server import REQUEST, generate_hashes


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """One tiny-checkpoint folder for every server and generate run of the session."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def reference(tmp_path_factory, tiny_cache):
    """``headmoe generate``'s (video_sha256, audio_sha256) of `REQUEST`."""
    return generate_hashes(tmp_path_factory.mktemp("generate"), tiny_cache, REQUEST)
