"""Engine connectors: thin role facades over the kvbm contract; they never own data."""
