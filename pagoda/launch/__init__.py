"""Starting and supervising Pagoda's processes: the launcher, its children, the sockets they share."""
