"""A user's first hour with a release folder (issue 31): no flag prefix matching, a `plan`
command that runs as printed, one-line warnings, the time estimate, the HTTP model field."""

from __future__ import annotations

import pytest

from headmoe.cli.main import build_parser, main


@pytest.mark.parametrize("argv, flag", [
    (["serve", "--offload"], "--offload"),
    (["generate", "--prompt", "x", "--num-inference", "2"], "--num-inference"),
    (["plan", "--world", "8"], "--world"),
    (["compare", "--layouts", "sp1", "--repe", "2"], "--repe"),
])
def test_no_subcommand_accepts_a_prefix_of_a_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert f"unrecognized arguments: {flag}" in err, err
    for name, sub in build_parser()._subparsers._group_actions[0].choices.items():
        assert sub.allow_abbrev is False, name
