package fence

// WorkerFunctions is workerFunctions, for the test that keeps it in step
// with the migrations' grants.
var WorkerFunctions = workerFunctions
