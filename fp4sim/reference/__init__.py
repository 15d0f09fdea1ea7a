"""Slow, obviously-correct implementations of SPEC.md, used as the test oracle.

Nothing here is fast or used by the library's own code paths; everything works on exact numbers (Python
integers and fractions, or float64 where every quantity involved is exactly representable).
"""
