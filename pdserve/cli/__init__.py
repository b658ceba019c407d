"""The `pdserve` command line: one subcommand per role, tool and offline use."""
