-- KEYS: all, session, its state, its events, its data, app index, user index
-- ARGV: B, now, member. Deletes the session, its events and its hold (a no-op
-- when absent); app and user state stay.
drop(KEYS[1], ARGV[3])
return 1
