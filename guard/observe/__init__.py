"""Watching a running job from the guard process: heartbeat, trackio, stacks."""
