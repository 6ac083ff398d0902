"""The ``trainforge`` command line: ``main.py`` and one module per subcommand."""
