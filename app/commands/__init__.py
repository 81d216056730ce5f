"""One module per `specchat` command that does more than run a generation: chat (the TUI), serve, bench,
models, cache and rpc-server. app/cli.py parses the command line and dispatches here; each module imports
llama.cpp only when its command runs, so `--help` answers at once."""
