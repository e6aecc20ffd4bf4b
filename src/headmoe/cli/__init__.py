"""The `headmoe` command line (console script `headmoe = headmoe.cli.main:main`)."""
