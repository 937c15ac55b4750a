-- The Debian guest's sqlite3 test (images/debian/workload.sql; kpin-workload runs
-- `sqlite3 -batch -bail DB < workload.sql`). Its output is deterministic: kpin-workload
-- hashes it.
PRAGMA journal_mode = DELETE;
CREATE TABLE t (id INTEGER PRIMARY KEY, k INTEGER NOT NULL, v TEXT NOT NULL);
BEGIN;
WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 100000)
INSERT INTO t (id, k, v) SELECT i, (i * 7919) % 10007, printf('row-%06d', i) FROM n;
COMMIT;
CREATE INDEX t_k ON t (k);
SELECT count(*), sum(k), min(v), max(v) FROM t;
SELECT k % 7 AS bucket, count(*), sum(id), avg(k) FROM t GROUP BY bucket ORDER BY bucket;
SELECT id, v FROM t WHERE k BETWEEN 5000 AND 5003 ORDER BY id;
SELECT count(*) FROM t WHERE v LIKE 'row-0999%';
DELETE FROM t WHERE id % 3 = 0;
SELECT count(*), total(k) FROM t;
