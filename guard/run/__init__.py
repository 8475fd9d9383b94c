"""The guard process: command line, config, stages, the supervisor's loop, the job's process tree, output."""
