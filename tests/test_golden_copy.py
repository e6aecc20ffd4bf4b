"""The repository's copy of the golden data (``golden/``) is complete and unaltered.

Every file listed in ``golden/MANIFEST.sha256`` exists with that hash and nothing else is
there; where ``../shared/golden`` exists (CI), the copy equals it file for file."""

from __future__ import annotations

import importlib.util

from tests.goldens import REPO, ROOT, SHARED


def _sync_module():
    spec = importlib.util.spec_from_file_location("sync_golden", REPO / "scripts" / "sync_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_copy_matches_its_manifest():
    sync = _sync_module()
    manifest = (ROOT / sync.MANIFEST).read_text().splitlines()
    assert len(manifest) >= 40, "golden/MANIFEST.sha256 lists too few files"
    assert sync.manifest_lines(ROOT) == manifest


def test_copy_equals_shared_golden_where_present():
    # A user's clone has no ../shared: then the manifest test above is the whole check.
    if not SHARED.is_dir():
        return
    sync = _sync_module()
    assert sync.manifest_lines(SHARED) == sync.manifest_lines(ROOT), (
        "golden/ differs from ../shared/golden: run scripts/sync_golden.py"
    )
