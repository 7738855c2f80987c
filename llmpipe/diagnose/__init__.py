"""Explaining performance and capacity: memory planning, cost model, diagnosis of a probe run."""
