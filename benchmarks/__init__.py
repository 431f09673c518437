"""Speed and accuracy targets, measured side by side (see each script's docstring); importable as a package."""
