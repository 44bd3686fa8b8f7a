"""Benchmarks behind `kvtier bench NAME`: each times a raw baseline in the same run and
prints the ratio. Modules expose HELP, add_arguments(parser) and run(args)."""
