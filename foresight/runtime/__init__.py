"""Process and file plumbing every layer uses: atomic writes, folder locks, the launcher's process group."""
