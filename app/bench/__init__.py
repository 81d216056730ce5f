"""`specchat bench`'s machinery: strategies side by side one request at a time (.solo), many clients through
the server's scheduler (.load), the prompt sets both use (.prompts) and the plot (.plot). The command
itself is app/commands/bench.py."""
