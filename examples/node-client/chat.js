#!/usr/bin/env node
// A Node.js client of Blazar's public gRPC API, blazar.v1.Inference.
//
// It loads the service from the repository's own .proto files at run time (no
// generated code, no copies), then:
//   1. lists the models the daemon serves (ListModels),
//   2. streams a chat, printing each text delta as it arrives (Chat),
//   3. makes one forced tool call (tool_choice naming a tool) and prints the call's
//      name and its arguments, parsed as JSON.
// Any error exits with status 1 and says why on stderr.
//
//   npm ci
//   BLAZAR_GRPC_ADDR=127.0.0.1:8421 node chat.js
//
// Environment: BLAZAR_GRPC_ADDR (host:port, default 127.0.0.1:8421, as `blazar serve`);
// BLAZAR_MODEL (a Lane name or alias; default: the first model that is ready).
"use strict";

const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "proto");
const ADDRESS = process.env.BLAZAR_GRPC_ADDR || "127.0.0.1:8421";
// The tool the model is made to call: name, description and JSON Schema parameters.
const TOOL = require("./tool.json");
// Every call gets a deadline: a daemon that hangs must not hang the client.
const DEADLINE_MS = 120_000;

function loadInference() {
  const definition = protoLoader.loadSync("blazar/v1/inference.proto", {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names as in the .proto: max_tokens, tool_choice, ...
    enums: String, // "FINISH_REASON_TOOL_CALLS" rather than 4
    longs: Number,
    defaults: true,
    oneofs: true, // chunk.part says which of `delta` / `final` is set
  });
  const v1 = grpc.loadPackageDefinition(definition).blazar.v1;
  return new v1.Inference(ADDRESS, grpc.credentials.createInsecure());
}

function deadline() {
  return new Date(Date.now() + DEADLINE_MS);
}

function listModels(client) {
  return new Promise((resolve, reject) => {
    client.ListModels({}, { deadline: deadline() }, (err, response) =>
      err ? reject(err) : resolve(response.models),
    );
  });
}

// Runs one Chat call; `onDelta` sees every Delta, the promise resolves to the Final.
function chat(client, request, onDelta) {
  return new Promise((resolve, reject) => {
    const call = client.Chat(request, { deadline: deadline() });
    let final = null;
    call.on("data", (chunk) => {
      if (chunk.part === "delta") onDelta(chunk.delta);
      else if (chunk.part === "final") final = chunk.final;
    });
    call.on("error", reject);
    call.on("end", () =>
      final ? resolve(final) : reject(new Error("the stream ended without a final chunk")),
    );
  });
}

async function streamChat(client, model) {
  console.log(`\nchat (${model}):`);
  let deltas = 0;
  const final = await chat(
    client,
    {
      model,
      messages: [{ role: "user", content: "Write one sentence about the sea." }],
      sampling: {
        max_tokens: 24,
        temperature: 0.7,
        seed: 42,
        // The bundled model is a small base model that may end its turn at once;
        // this keeps it writing to max_tokens, so that there is always a stream to see.
        ignore_eos: true,
      },
    },
    (delta) => {
      deltas += 1;
      process.stdout.write(delta.text);
    },
  );
  const usage = final.usage || {};
  console.log(
    `\nstreamed ${deltas} deltas, finish ${final.finish_reason}, ` +
      `${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens, ` +
      `lane ${final.model}`,
  );
  if (deltas === 0) throw new Error("the chat streamed no delta");
}

async function forcedToolCall(client, model) {
  console.log(`\nforced tool call (${TOOL.name}):`);
  const calls = []; // by index: {id, name, arguments (JSON text, joined from fragments)}
  const final = await chat(
    client,
    {
      model,
      messages: [{ role: "user", content: "What is the weather in Paris tomorrow?" }],
      tools: [
        {
          name: TOOL.name,
          description: TOOL.description,
          parameters: JSON.stringify(TOOL.parameters), // the schema travels as JSON text
        },
      ],
      tool_choice: { mode: "MODE_NAMED", name: TOOL.name },
      parallel_tool_calls: false,
      // The call is forced by a grammar, which ends the output; this is only an upper
      // bound (the longest call this schema allows is well under it).
      sampling: { max_tokens: 512, seed: 7 },
    },
    (delta) => {
      for (const part of delta.tool_calls) {
        const call = (calls[part.index] ||= { id: "", name: "", arguments: "" });
        call.id += part.id;
        call.name += part.name;
        call.arguments += part.arguments;
      }
    },
  );
  if (final.finish_reason !== "FINISH_REASON_TOOL_CALLS") {
    throw new Error(`expected a tool call, the turn ended with ${final.finish_reason}`);
  }
  // Only the first `final.tool_calls` calls are whole (see Final.tool_calls).
  const whole = calls.slice(0, final.tool_calls);
  if (whole.length !== 1) throw new Error(`expected one whole call, got ${whole.length}`);
  const [call] = whole;
  const args = JSON.parse(call.arguments); // throws, so exits 1, if it is not JSON
  console.log(`tool call: ${call.name} ${JSON.stringify(args)}`);
  console.log(`call id: ${call.id}`);
}

async function main() {
  const client = loadInference();
  try {
    const models = await listModels(client);
    console.log(`models at ${ADDRESS}:`);
    for (const m of models) {
      console.log(`  ${m.id}  (lane ${m.lane}, ${m.ready ? "ready" : "not ready"})`);
    }
    const model = process.env.BLAZAR_MODEL || (models.find((m) => m.ready) || {}).id;
    if (!model) throw new Error("no model is ready");
    await streamChat(client, model);
    await forcedToolCall(client, model);
  } finally {
    client.close();
  }
}

main().catch((err) => {
  // A gRPC error carries a status code and Blazar's reason as a plain trailer.
  if (err.code !== undefined && err.metadata) {
    const reason = err.metadata.get("blazar-reason")[0];
    const name = grpc.status[err.code] || err.code;
    console.error(`error: gRPC ${name}${reason ? ` (${reason})` : ""}: ${err.details}`);
  } else {
    console.error(`error: ${err.message || err}`);
  }
  process.exitCode = 1;
});
