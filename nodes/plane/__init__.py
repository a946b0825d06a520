"""The plane's own actors between the roles: the staleness governor and the trajectory buffer."""
