"""Adapters that let serving engines use kvtiers through their own plug-in points.

Each engine lives in its own subpackage and is imported only when the engine loads it, so
``import kvtiers`` never imports an engine.
"""
