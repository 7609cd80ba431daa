"""The CLI room: every ``bear`` subcommand (one module per part: ``bear.commands.router``,
``bear.commands.stack``, …) and the options they all spell the same way (``options.py``).

Only the CLI root ``bear.cli`` imports these modules; nothing below them imports the CLI."""
