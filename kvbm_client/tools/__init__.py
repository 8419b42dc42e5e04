"""Small stand-alone programs that serve beside kvbm (no daemon imports them)."""
