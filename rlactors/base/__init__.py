"""Below the sockets, in every runtime process: errors, the loop's helpers, awake time, logging,
forensics, typed TOML, class paths."""
