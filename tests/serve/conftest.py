import pytest

from tests.goldens import golden_file
from tests.serve.server import REFINED, REQUEST, generate_hashes


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """One tiny-checkpoint folder for every server and generate run of the session."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def reference(tmp_path_factory, tiny_cache):
    """``headmoe generate``'s (video_sha256, audio_sha256) of `REQUEST`."""
    return generate_hashes(tmp_path_factory.mktemp("generate"), tiny_cache, REQUEST)


#: the image of the image-to-video requests (a golden test image; 37 x 23 RGB PNG)
I2V_IMAGE = golden_file("magi2_pipeline", "images/landscape_37x23.png")


@pytest.fixture(scope="session")
def i2v_reference(tmp_path_factory, tiny_cache):
    """``headmoe generate --image I2V_IMAGE``'s (video_sha256, audio_sha256) of `REQUEST`."""
    return generate_hashes(tmp_path_factory.mktemp("generate-i2v"), tiny_cache,
                           {**REQUEST, "image": str(I2V_IMAGE)})


@pytest.fixture(scope="session")
def refined_reference(tmp_path_factory, tiny_cache):
    """``headmoe generate``'s (video_sha256, audio_sha256) of `REFINED` (the tiny release's
    refiner/ at a small size after the preview)."""
    return generate_hashes(tmp_path_factory.mktemp("generate-refined"), tiny_cache, REFINED)
