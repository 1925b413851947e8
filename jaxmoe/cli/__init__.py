"""The ``jaxmoe`` command line: parsing, the subcommands, the launcher and run directories."""
