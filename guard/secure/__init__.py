"""Securing checkpoints: the deadline, the plan, destinations and the push."""
